"""Tensor parallelism (issue #39): Omni's plain-collective layer vs torch's DTensor API, next to one process.

    .venv/bin/python bench/parallel_tp.py [--heads 8] [--head-dim 64] [--layers 2] [--size 32] [--text 64]
                                          [--rounds 15]
    .venv/bin/python bench/parallel.py --tp ...          # the same

The model is diffusers' ``QwenImageTransformer2DModel`` (random weights, ``heads x head-dim`` wide, ``--layers``
dual-stream blocks; ``(size/2)^2`` image + ``--text`` text tokens) with the Qwen-Image plugin's own ``TP_PLAN``
(attention q/k/v and text q/k/v colwise, both output projections rowwise, both MLPs, the modulation Linears
``colwise_gather``). That plan is one DTensor can express as it is: ``colwise`` is ``ColwiseParallel()``,
``rowwise`` is ``RowwiseParallel()``, ``colwise_gather`` is ``ColwiseParallel(output_layouts=Replicate())``;
Wan's ``norm_across_heads`` and FLUX's segmented ``rowwise`` have no DTensor style, which is why the comparison
uses Qwen-Image. Both variants divide the attention modules' head counts the same way (diffusers' processor
unflattens by ``attn.heads``), so only the split layers' mechanism differs.

Two gloo processes on this machine's cores, one forward per variant per round, the variants' order rotated each
round (paired rounds): ``one process`` is rank 0 alone with ``cores`` torch threads (rank 1 waits in a
barrier), ``omni TP-2`` is ``apply_tensor_parallel`` and ``DTensor TP-2`` is ``parallelize_module`` on both ranks
with ``cores / 2`` threads each. Reported: the median forward (rank 0, barrier to barrier), its ratio to one
process and to Omni's layer, the max |diff| from the one-process output, and the parameter bytes each rank
holds (DTensor parameters counted by their local shard). The tiny model's byte fraction is dominated by what
stays whole (input/output projections, time embedding); the released configs' fractions (``param_shards`` on
``meta``, as ``tests/distributed/test_tensor_parallel_plan.py``) are printed below the table.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("one process", "omni TP-2", "DTensor TP-2")


def _model(args: dict):
    import torch
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(0)
    hd = args["head_dim"]
    rope = (hd // 8, (hd - hd // 8) // 2, (hd - hd // 8) // 2)  # even parts summing to the head dim
    return QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=args["layers"],
                                       attention_head_dim=hd, num_attention_heads=args["heads"],
                                       joint_attention_dim=args["heads"] * hd, axes_dims_rope=rope).eval()


def _param_bytes(module) -> int:
    from torch.distributed.tensor import DTensor

    return sum((p.to_local() if isinstance(p, DTensor) else p).nbytes for p in module.parameters())


def run(rank: int, world_size: int, args: dict) -> dict:
    """Every rank: build three copies (whole, Omni-split, DTensor-split), time them in rotated rounds."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from omni_core.config import ParallelConfig
    from omni_core.distributed import get_tp_group, get_world_group, init_parallel_state
    from omni_core.distributed.tensor_parallel import TensorParallelPlan, _divide_heads, apply_tensor_parallel
    from omni_model_qwen_image.pipeline import TP_PLAN

    init_parallel_state(ParallelConfig(tensor_parallel_size=world_size))
    tp, world = get_tp_group(), get_world_group()
    whole, omni, dtensor = _model(args), _model(args), _model(args)
    apply_tensor_parallel(omni, TP_PLAN, tp)
    layers = TensorParallelPlan.coerce(TP_PLAN).resolve(dtensor)
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel,
              "colwise_gather": lambda: ColwiseParallel(output_layouts=Replicate())}
    mesh = DeviceMesh.from_group(tp.group, "cpu")
    parallelize_module(dtensor, mesh, {name: styles[s.style]() for name, s in layers.items()})
    _divide_heads(dtensor, layers, world_size)

    g = torch.Generator().manual_seed(1)
    side = args["size"] // 2
    inputs = dict(hidden_states=torch.randn(1, side * side, 16, generator=g),
                  encoder_hidden_states=torch.randn(1, args["text"], args["heads"] * args["head_dim"], generator=g),
                  encoder_hidden_states_mask=torch.ones(1, args["text"]), timestep=torch.tensor([0.5]),
                  img_shapes=[[(1, side, side)]], return_dict=False)
    cores, models = args["cores"], {"one process": whole, "omni TP-2": omni, "DTensor TP-2": dtensor}
    threads = {"one process": cores, "omni TP-2": max(1, cores // world_size),
               "DTensor TP-2": max(1, cores // world_size)}

    def forward(name):
        torch.set_num_threads(threads[name])
        world.barrier()
        start = time.perf_counter()
        out = None
        if name != "one process" or rank == 0:
            out = models[name](**inputs)[0]
        world.barrier()
        return time.perf_counter() - start, out

    times: dict[str, list[float]] = {n: [] for n in VARIANTS}
    outs = {}
    with torch.inference_mode():
        for name in VARIANTS:  # warm-up, and the outputs compared
            outs[name] = forward(name)[1]
        for r in range(args["rounds"]):
            for name in VARIANTS[r % 3:] + VARIANTS[:r % 3]:
                times[name].append(forward(name)[0])
    result = {"bytes": {n: _param_bytes(m) for n, m in models.items()}, "times": times}
    if rank == 0:
        result["diff"] = {n: float((outs[n] - outs["one process"]).abs().max()) for n in VARIANTS}
    return result


def real_fractions() -> dict[str, float]:
    """Parameter bytes per TP-2 rank / one process for the released configs (on ``meta``), as the plan test."""
    from omni_core.distributed.tensor_parallel import TensorParallelPlan, param_shards

    path = ROOT / "tests" / "distributed" / "test_tensor_parallel_plan.py"
    spec = importlib.util.spec_from_file_location("omni_bench_tp_plan", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = {}
    for name, (model, plan) in module._real_models().items():
        shards = param_shards(model, TensorParallelPlan.coerce(plan).resolve(model), 2)
        full = sum(p.numel() for p in model.parameters())
        split = sum(model.get_parameter(p).numel() for p in shards)
        out[name] = (full - split / 2) / full
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--size", type=int, default=32, help="latent height = width ((size/2)^2 image tokens)")
    parser.add_argument("--text", type=int, default=64, help="text tokens")
    parser.add_argument("--rounds", type=int, default=15)
    opts = parser.parse_args(argv)

    import torch

    from omni_core.distributed import spawn_workers

    cores = os.cpu_count() or 1
    args = {"heads": opts.heads, "head_dim": opts.head_dim, "layers": opts.layers, "size": opts.size,
            "text": opts.text, "rounds": opts.rounds, "cores": cores}
    print(f"QwenImageTransformer2DModel dim={opts.heads * opts.head_dim} ({opts.heads} heads x {opts.head_dim}), "
          f"{opts.layers} blocks, {(opts.size // 2) ** 2} image + {opts.text} text tokens, fp32, torch "
          f"{torch.__version__}, {cores} CPU cores, gloo, {opts.rounds} rotated rounds; load average before "
          f"{os.getloadavg()[0]:.2f}")
    res = spawn_workers(f"{__file__}:run", 2, (args,), timeout=600, threads=max(1, cores // 2))
    load_after = os.getloadavg()[0]
    med = {n: statistics.median(res[0]["times"][n]) for n in VARIANTS}
    print(f"{'variant':<14}{'ms/forward (median)':>21}{'vs 1 process':>14}{'vs omni TP-2':>14}"
          f"{'max |diff|':>12}{'param MB/rank':>15}{'vs 1 process':>14}")
    one_bytes = res[0]["bytes"]["one process"]
    for n in VARIANTS:
        nbytes = max(r["bytes"][n] for r in res)
        print(f"{n:<14}{1e3 * med[n]:>21.1f}{med[n] / med['one process']:>13.2f}x"
              f"{med[n] / med['omni TP-2']:>13.2f}x{res[0]['diff'][n]:>12.2e}{nbytes / 1e6:>15.2f}"
              f"{nbytes / one_bytes:>13.3f}x")
    print(f"load average after {load_after:.2f}")
    print("param bytes per TP-2 rank / one process, released configs (declared plans, on meta): "
          + ", ".join(f"{k} {v:.3f}" for k, v in real_fractions().items()))


if __name__ == "__main__":
    sys.exit(main())

"""Sequence / CFG parallelism on a tiny transformer: time per step and bytes communicated, next to one process.

    .venv/bin/python bench/parallel.py [--size 64] [--dim 256] [--depth 2] [--steps 5] [--only ring2,cfg2]

One "step" is what a denoise step does: the positive and the negative (CFG) branch of ``TinyDiT`` (latents
``[1, 4, size, size]``, patch 2, so ``(size/2)^2`` image tokens, plus 32 text tokens in joint attention).
Each configuration runs in its own set of processes joined by gloo (``torch.set_num_threads`` = cores /
processes, at least 1). Reported per configuration: mean wall time per step on rank 0 (ranks synchronised
by a barrier before and after the timed steps), bytes sent per step by the busiest rank and by all ranks
(counted by ``GroupCoordinator``), and the largest absolute difference of the guided output from the
single-process run. On a CPU box the processes share the same cores, so speed-ups are bounded by the core
count; the byte counts do not depend on the machine.

With ``--model`` the same comparison runs a real model through the engine
(``Omni(model, parallel_config=...)``, the ``mp`` executor with gloo workers for more than one process)::

    .venv/bin/python bench/parallel.py --model shapes [--steps 8] [--requests 2] [--only ulysses2,cfg2]
    .venv/bin/python bench/parallel.py --model tiny-qwen --size 64     # builds a tiny Qwen-Image (4 heads)
    .venv/bin/python bench/parallel.py --model tiny-wan --size 32 --frames 9   # tiny Wan 2.2, 4 heads
    .venv/bin/python bench/parallel.py --model /path/to/diffusers/folder

Each configuration starts its own engine in step mode with streaming outputs, runs one untimed warm-up
request, then submits ``--requests`` requests (different seeds, each with CFG) at once. Reported: the
median worker time of a denoise-only wave (``metrics["step_time_s"]``: denoise + scheduler step, without the
first wave's prompt encoding and the last wave's decode), the bytes the replica's first rank sent in such a
wave (``metrics["communication_bytes"]``), the bench's wall time per denoising step of all requests together
(throughput; data parallel shows here), and the largest difference of the float outputs from one process.
Configurations the model refuses at start-up (e.g. a Ulysses degree that does not divide the heads) are
listed as skipped with the reason.

Tensor parallelism and the split VAE decode (issue #39) have their own scripts, also reachable from here::

    .venv/bin/python bench/parallel.py --tp [...]        # = bench/parallel_tp.py: Omni's TP layer vs DTensor
    .venv/bin/python bench/parallel.py --decode [...]    # = bench/parallel_decode.py: decode memory per rank
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "distributed" / "tiny_dit.py"

CONFIGS = {
    "single": {},
    "ulysses2": {"ulysses_degree": 2},
    "ring2": {"ring_degree": 2},
    "ulysses4": {"ulysses_degree": 4},
    "ring4": {"ring_degree": 4},
    "ulysses2xring2": {"ulysses_degree": 2, "ring_degree": 2},
    "cfg2": {"cfg_parallel_size": 2},
}


def _load_tiny():
    spec = importlib.util.spec_from_file_location("omni_bench_tiny_dit", TINY)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def run(rank: int, world_size: int, cfg: dict, args: dict) -> dict:
    """Runs in every process of one configuration."""
    import torch

    from omni_core.attention.parallel import apply_sequence_parallel
    from omni_core.config import ParallelConfig
    from omni_core.distributed import (cfg_parallel_guidance, communication_stats, get_world_group,
                                       init_parallel_state, reset_communication_stats)

    tiny = _load_tiny()
    init_parallel_state(ParallelConfig.from_kwargs(**cfg))
    model = tiny.build(tiny.TinyDiT, seed=0, dim=args["dim"], heads=args["heads"], depth=args["depth"])
    apply_sequence_parallel(model)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 4, args["size"], args["size"], generator=g)
    pos, pmask = tiny.text_inputs(1, 32, seed=1)
    neg, nmask = tiny.text_inputs(1, 32, seed=2)
    t = torch.tensor([0.5])
    world = get_world_group()

    def step():
        return cfg_parallel_guidance(lambda: model(x, pos, pmask, t), lambda: model(x, neg, nmask, t), 4.0)

    with torch.inference_mode():
        out = step()  # warm-up
        world.barrier()
        reset_communication_stats()
        start = time.perf_counter()
        for _ in range(args["steps"]):
            out = step()
        world.barrier()
        elapsed = (time.perf_counter() - start) / args["steps"]
    sent = communication_stats()
    sent.pop("world", None)  # the barrier's group; barriers send nothing we count
    return {"seconds": elapsed, "bytes": sent["total"] / args["steps"], "out": out if rank == 0 else None,
            "threads": torch.get_num_threads()}


#: engine mode: the same strategies plus data parallel (replicas take different requests)
MODEL_CONFIGS = {**CONFIGS, "dp2": {"data_parallel_size": 2}}


def _model_folder(name: str, size: int | None) -> tuple[str, dict]:
    """(model for ``Omni``, sampling defaults) for ``--model``: ``tiny-qwen`` / ``tiny-wan`` are built into a
    temp folder (4 heads, so Ulysses 2 and 4 apply)."""
    import tempfile

    if name == "tiny-qwen":
        from omni_model_qwen_image.testing import build_tiny_qwen_image

        folder = build_tiny_qwen_image(tempfile.mkdtemp(prefix="omni-bench-qwen-"), num_heads=4)
        return folder, {"height": size or 64, "width": size or 64, "true_cfg_scale": 4.0}
    if name == "tiny-wan":
        from omni_model_wan.testing import build_tiny_wan

        folder = build_tiny_wan(tempfile.mkdtemp(prefix="omni-bench-wan-"), two_experts=True, num_heads=4)
        return folder, {"height": size or 32, "width": size or 32, "guidance_scale": 4.0}
    params = {"height": size, "width": size} if size else {}
    return name, params


def run_model(model: str, parallel_config: dict, params: dict, n_requests: int, threads: int = 0) -> dict:
    """One engine: a warm-up request, then ``n_requests`` at once. Per-wave metrics of denoise-only waves."""
    import torch

    from omni_core import Omni
    from omni_core.config import SamplingParams
    from omni_core.request import OmniDiffusionRequest

    def submit(engine, seed):
        request = OmniDiffusionRequest(prompt=PROMPTS[seed % len(PROMPTS)], negative_prompt="blurry, low quality",
                                       sampling_params=SamplingParams(seed=seed, output_type="pt", **params))
        (handle,) = engine.submit([request])
        return handle

    def drain(stream, waves):
        seen = 0
        while True:
            out = stream.get(timeout=600)
            if out.finished:
                if out.status != "completed":
                    raise RuntimeError(f"request failed: {out.error}")
                return out
            seen += 1
            if seen > 1:  # the first wave also encodes the prompt
                waves.append(out.metrics)

    if threads:  # the single-process engine computes in this process (workers use cores / processes)
        torch.set_num_threads(threads)
    # oversubscribe: the 4-rank layouts are measured on machines with fewer cores too (see docs/benchmarks.md)
    with Omni(model, parallel_config=parallel_config, dtype="float32", warmup=False, step_execution=True,
              streaming_output=True, max_num_seqs=max(1, n_requests), oversubscribe=True) as omni:
        drain(submit(omni.engine, 1000), [])
        waves: list[dict] = []
        start = time.perf_counter()
        streams = [submit(omni.engine, seed) for seed in range(n_requests)]
        outs = [drain(s, waves) for s in streams]
        wall = time.perf_counter() - start
    steps = sum(o.num_steps for o in outs)
    return {"step_ms": 1e3 * float(torch.tensor([w["step_time_s"] for w in waves]).median()),
            "bytes": float(torch.tensor([float(w.get("communication_bytes", 0)) for w in waves]).median()),
            "wall_ms_per_step": 1e3 * wall / steps * n_requests,
            "images": [torch.stack(list(o.images)).float() for o in outs]}


PROMPTS = ["a red circle in the top left", "a blue square in the centre", "a green triangle at the bottom right"]


def main_model(opts) -> None:
    from omni_core.config import ParallelConfig
    from omni_core.errors import ConfigError

    model, params = _model_folder(opts.model, opts.size if opts.size_given else None)
    params = {**params, "num_inference_steps": opts.steps}
    if opts.frames:
        params["num_frames"] = opts.frames
    names = [n for n in MODEL_CONFIGS if not opts.only or n in opts.only.split(",")]
    if "single" not in names:
        names.insert(0, "single")
    print(f"model {opts.model}: {params}, {opts.requests} request(s) with CFG at once, step mode, "
          f"{os.cpu_count()} CPU cores, gloo")
    rows, skipped, base = [], [], None
    for name in names:
        cfg = MODEL_CONFIGS[name]
        world = ParallelConfig.from_kwargs(**cfg).world_size
        try:
            res = run_model(model, cfg, params, opts.requests, opts.threads if world == 1 else 0)
        except ConfigError as exc:
            skipped.append((name, str(exc)))
            continue
        if base is None:
            base = res
        diff = max(float((a - b).abs().max()) for a, b in zip(res["images"], base["images"]))
        rows.append((name, world, res["step_ms"], base["step_ms"] / res["step_ms"], res["wall_ms_per_step"],
                     base["wall_ms_per_step"] / res["wall_ms_per_step"], res["bytes"], diff))
    print(f"{'strategy':<16}{'procs':>6}{'ms/step':>10}{'vs 1':>8}{'wall ms/step':>14}{'vs 1':>8}"
          f"{'KB sent/step (rank 0)':>24}{'max |diff|':>12}")
    for name, world, ms, speed, wall, wspeed, nbytes, diff in rows:
        print(f"{name:<16}{world:>6}{ms:>10.1f}{speed:>7.2f}x{wall:>14.1f}{wspeed:>7.2f}x{nbytes / 1e3:>24.1f}"
              f"{diff:>12.2e}")
    for name, why in skipped:
        print(f"{name}: skipped: {why}")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("--tp", "--decode"):
        name = {"--tp": "parallel_tp", "--decode": "parallel_decode"}[sys.argv[1]]
        spec = importlib.util.spec_from_file_location(f"omni_bench_{name}", ROOT / "bench" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.main(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None,
                        help="run a model through the engine: shapes, tiny-qwen, tiny-wan or a model folder/name")
    parser.add_argument("--requests", type=int, default=2, help="--model: requests submitted at once")
    parser.add_argument("--frames", type=int, default=0, help="--model: num_frames (video models)")
    parser.add_argument("--size", type=int, default=64, help="latent height = width (tokens = (size/2)^2)")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--depth", type=int, default=2, help="groups of (joint, self, cross) blocks")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads per process (0: cores / processes)")
    parser.add_argument("--only", default="", help=f"comma-separated subset of {', '.join(CONFIGS)}")
    opts = parser.parse_args()
    opts.size_given = "--size" in sys.argv
    if opts.model:
        if "--steps" not in sys.argv:
            opts.steps = 8
        main_model(opts)
        return

    from omni_core.distributed import spawn_workers

    names = [n for n in CONFIGS if not opts.only or n in opts.only.split(",")]
    if "single" not in names:
        names.insert(0, "single")
    bench_args = {k: getattr(opts, k) for k in ("size", "dim", "heads", "depth", "steps")}
    cores = os.cpu_count() or 1
    tokens = (opts.size // 2) ** 2
    print(f"TinyDiT dim={opts.dim} heads={opts.heads} blocks={3 * opts.depth}, {tokens} image + 32 text tokens, "
          f"CFG (2 forwards) per step, {opts.steps} timed steps, {cores} CPU cores, gloo")
    rows, base = [], None
    for name in names:
        cfg = CONFIGS[name]
        from omni_core.config import ParallelConfig

        world = ParallelConfig.from_kwargs(**cfg).world_size
        threads = opts.threads or max(1, cores // world)
        res = spawn_workers(f"{__file__}:run", world, (cfg, bench_args), timeout=1800, threads=threads)
        seconds = res[0]["seconds"]
        per_rank = max(r["bytes"] for r in res)
        total = sum(r["bytes"] for r in res)
        if base is None:
            base = (seconds, res[0]["out"])
        diff = float((res[0]["out"] - base[1]).abs().max())
        rows.append((name, world, threads, seconds * 1e3, base[0] / seconds, per_rank, total, diff))
    header = ("strategy", "procs", "thr", "ms/step", "speed-up", "MB sent/step (max rank)", "MB sent/step (all)",
              "max |diff|")
    print(f"{header[0]:<16}{header[1]:>6}{header[2]:>5}{header[3]:>10}{header[4]:>10}{header[5]:>25}"
          f"{header[6]:>20}{header[7]:>12}")
    for name, world, threads, ms, speed, per_rank, total, diff in rows:
        print(f"{name:<16}{world:>6}{threads:>5}{ms:>10.1f}{speed:>9.2f}x{per_rank / 1e6:>25.3f}"
              f"{total / 1e6:>20.3f}{diff:>12.2e}")


if __name__ == "__main__":
    main()

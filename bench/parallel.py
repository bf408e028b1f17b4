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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=64, help="latent height = width (tokens = (size/2)^2)")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--depth", type=int, default=2, help="groups of (joint, self, cross) blocks")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads per process (0: cores / processes)")
    parser.add_argument("--only", default="", help=f"comma-separated subset of {', '.join(CONFIGS)}")
    opts = parser.parse_args()

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

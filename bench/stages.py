"""Stages apart (issue #40): the in-line pipeline vs ``encode_workers=1, decode_workers=1`` on a decode-heavy
tiny video model.

    .venv/bin/python bench/stages.py [--requests 16] [--rounds 3] [--vae-dim 32] [--size 64] [--frames 5]
                                     [--steps 50] [--max-num-seqs 1] [--request-mode] [--cpu-threads N]
                                     [--split encode_workers=1,decode_workers=1]

The model is a tiny Wan 2.1 folder built here whose video VAE (``base_dim=--vae-dim``, 12.9 MB) is larger and
slower than its transformer (0.1 MB), as a real video model's decode is a large share of a request; by default
the denoiser runs one request at a time (``max_num_seqs=1``, as a video model does on one device), so the
denoise and the decode of a request take comparable time and pipelining them has something to overlap. Both
engines are started once and stay up; each round submits ``--requests`` concurrent requests (one prompt, one seed
each) to one, then the other, the order alternating per round (paired rounds). Reported: requests per second of
each and their ratio (median over rounds), the outputs' max |diff| split vs in line, the load average before
and after, and the parameter bytes each process holds (``stats()["model_bytes"]`` of the model process,
``stats()["stages"][stage]["model_bytes"]`` of each stage process).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time


def build_folder(path: str, vae_dim: int) -> str:
    """A tiny Wan folder (the test transformer and text encoder) with a ``vae_dim``-wide VAE."""
    import torch
    from diffusers import AutoencoderKLWan, WanPipeline
    from omni_model_wan.testing import tiny_wan_components

    components = tiny_wan_components()
    torch.manual_seed(0)
    components["vae"] = AutoencoderKLWan(base_dim=vae_dim, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                                         temperal_downsample=[False, True, True])
    WanPipeline(**components).save_pretrained(path, safe_serialization=True)
    return path


def run_round(omni, args) -> tuple[float, list]:
    from omni_core.config import SamplingParams
    from omni_core.request import OmniDiffusionRequest

    params = dict(height=args.size, width=args.size, num_frames=args.frames, num_inference_steps=args.steps,
                  guidance_scale=1.0, max_sequence_length=32)
    engine = omni.engine
    requests = [engine.prepare_request(OmniDiffusionRequest(prompt="a red circle moving right",
                                                            sampling_params=SamplingParams(seed=s, **params)))
                for s in range(args.requests)]
    t0 = time.perf_counter()
    handles = engine.submit(requests)
    outs = [h.result() for h in handles]
    wall = time.perf_counter() - t0
    assert all(o.status == "completed" for o in outs), [o.error for o in outs]
    return wall, [o.tensor for o in outs]


def cpu_busy(seconds: float = 2.0) -> float | None:
    """Cores busy over ``seconds`` (``/proc/stat``) before the engines start: what other work leaves the bench.
    Pipelining the stages gains only while a core would idle in line; on two cores another process keeps busy,
    there is little for the second process to fill."""
    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
        return sum(ticks), ticks[3] + ticks[4]  # all, idle + iowait

    try:
        (t0, i0), _, (t1, i1) = sample(), time.sleep(seconds), sample()
    except (OSError, ValueError, IndexError):
        return None
    return (os.cpu_count() or 1) * (1 - (i1 - i0) / max(1, t1 - t0))


def parse_split(text: str) -> dict:
    """``encode_workers=1,decode_workers=1`` -> keyword arguments of the split engine."""
    out = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        out[key.strip()] = int(value) if value.strip().isdigit() else value.strip()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--vae-dim", type=int, default=32)
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--frames", type=int, default=5)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--max-num-seqs", type=int, default=1)
    p.add_argument("--request-mode", action="store_true")
    p.add_argument("--split", default="encode_workers=1,decode_workers=1",
                   help="the split engine's options, over the common ones (default: both stages apart; e.g. "
                        "'decode_workers=1,cpu_threads=1')")
    p.add_argument("--cpu-threads", type=int, default=None,
                   help="torch threads of every process (default: the engine's policy, under which a contended "
                        "model process runs a wave on one thread: then the two runs' decodes may sum differently)")
    args = p.parse_args()
    from omni_core import Omni

    folder = build_folder(tempfile.mkdtemp(prefix="omni-stages-"), args.vae_dim)
    split = parse_split(args.split)
    label = ", ".join(f"{k}={v}" for k, v in split.items())
    load_before, busy_before = os.getloadavg(), cpu_busy()
    common = dict(warmup=False, step_execution=not args.request_mode, max_num_seqs=args.max_num_seqs,
                  cpu_threads=args.cpu_threads)
    engines = {"in line": Omni(folder, **common), label: Omni(folder, **{**common, **split})}
    try:
        for omni in engines.values():  # one untimed round each: first-call costs out of the way
            run_round(omni, argparse.Namespace(**{**vars(args), "requests": 2}))
        walls: dict[str, list[float]] = {k: [] for k in engines}
        diffs = []
        for r in range(args.rounds):
            names = list(engines) if r % 2 == 0 else list(reversed(engines))
            tensors = {}
            for name in names:
                wall, tensors[name] = run_round(engines[name], args)
                walls[name].append(wall)
            diffs.append(max(float((a - b).abs().max()) for a, b in zip(*tensors.values())))
        load_after = os.getloadavg()
        stats = {k: o.engine.stats() for k, o in engines.items()}
    finally:
        for omni in engines.values():
            omni.close()
    mode = "request" if args.request_mode else "step"
    print(f"tiny Wan, VAE base_dim={args.vae_dim}, {args.size}x{args.size}x{args.frames} frames, {args.steps} steps, "
          f"{mode} mode, max_num_seqs={args.max_num_seqs}, cpu_threads={args.cpu_threads}; {args.requests} "
          f"concurrent requests x {args.rounds} paired rounds; {os.cpu_count()} CPUs")
    rates = {k: statistics.median(args.requests / w for w in ws) for k, ws in walls.items()}
    for name, rate in rates.items():
        print(f"  {name:38s} {rate:7.2f} req/s   (walls: {', '.join(f'{w:.2f}' for w in walls[name])} s)")
    ratios = [a / b for a, b in zip(walls["in line"], walls[label])]
    print(f"  throughput ratio split / in line: {statistics.median(ratios):.2f}x "
          f"(per round: {', '.join(f'{x:.2f}' for x in ratios)})")
    print(f"  max |diff| of the outputs: {max(diffs):.2e}")
    if busy_before is not None:
        print(f"  cores busy before the engines started (/proc/stat, 2 s): {busy_before:.2f} of {os.cpu_count()}")
    print(f"  load average before: {' '.join(f'{x:.2f}' for x in load_before)}; after: "
          f"{' '.join(f'{x:.2f}' for x in load_after)}")
    print("  parameter bytes per process:")
    print(f"    in line, model process:   {stats['in line']['model_bytes']}")
    print(f"    split, model process:     {stats[label]['model_bytes']}")
    for stage, info in stats[label].get("stages", {}).items():
        print(f"    split, {stage} process:    {info['model_bytes']}")


if __name__ == "__main__":
    sys.exit(main())

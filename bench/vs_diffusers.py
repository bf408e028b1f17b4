"""Omni vs diffusers on the same tiny model: one request's latency, and throughput for 8 concurrent requests.

    .venv/bin/python bench/vs_diffusers.py                    # Qwen-Image and Wan 2.2, tiny random folders
    .venv/bin/python bench/vs_diffusers.py --model wan --steps 8 --repeats 5
    .venv/bin/python bench/vs_diffusers.py --folder /models/Qwen-Image --height 512 --width 512

For each model it prints, side by side:

* latency: the median wall time of one request through ``Omni(model=<folder>)`` (``Omni.generate``, engine,
  scheduler and executor included) over the median of diffusers' pipeline ``__call__`` on the same folder;
* throughput: 8 requests submitted together to Omni (``max_num_seqs=8``, request mode by default, so they run
  as one batch; ``--mode step`` for step waves) over diffusers running the same 8 requests one after another
  (requests per second, higher is better).

Both sides use float32 on the CPU (or ``--device``), the same prompts, seeds, size and steps, CFG on.
The tiny folders are built in a temp dir with the plugins' own builders (random weights; no download).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROMPTS = ["a red fox jumping over a lazy dog in a snowy forest", "a cat", "an astronaut riding a horse on the moon",
           "a bowl of fruit on a wooden table", "city skyline at night, neon", "a lighthouse in a storm",
           "portrait of an old sailor", "a field of sunflowers under a blue sky"]
NEG = "blurry, low quality"


def build_folder(kind: str, root: str) -> str:
    if kind == "qwen":
        from omni_model_qwen_image.testing import build_tiny_qwen_image

        return build_tiny_qwen_image(os.path.join(root, "tiny-qwen-image"))
    from omni_model_wan.testing import build_tiny_wan

    return build_tiny_wan(os.path.join(root, "tiny-wan22"), two_experts=True)


def call_kwargs(kind: str, args: argparse.Namespace) -> dict:
    """Keyword arguments valid for both ``Omni.generate`` and the diffusers pipeline."""
    common = {"height": args.height, "width": args.width, "num_inference_steps": args.steps}
    if kind == "qwen":
        return {**common, "true_cfg_scale": 4.0}
    return {**common, "num_frames": args.frames, "guidance_scale": 5.0}


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench(kind: str, folder: str, args: argparse.Namespace) -> list[tuple[str, float, float, str]]:
    import torch

    from omni_core import Omni

    kwargs = call_kwargs(kind, args)

    from diffusers import DiffusionPipeline

    ref = DiffusionPipeline.from_pretrained(folder, use_safetensors=True).to(args.device)
    ref.set_progress_bar_config(disable=True)

    def run_diffusers(prompt: str, seed: int):
        ref(prompt, negative_prompt=NEG, generator=torch.Generator(args.device).manual_seed(seed),
            output_type="pil", **kwargs)

    n = len(PROMPTS)
    with Omni(folder, dtype="float32", warmup=False, max_num_seqs=n, step_execution=args.mode == "step") as omni:
        def run_omni(prompts: list[str], seed: int):
            omni.generate([{"prompt": p, "negative_prompt": NEG} for p in prompts], seed=seed, use_tqdm=False,
                          **kwargs)

        run_omni(PROMPTS[:1], 0)  # warm both sides up (first-call allocations, lazy imports)
        run_omni(PROMPTS, 0)
        run_diffusers(PROMPTS[0], 0)
        lat_o, lat_d, thr_o, thr_d = [], [], [], []
        for r in range(args.repeats):  # interleaved, so drift in machine load hits both sides alike
            lat_o.append(timed(lambda: run_omni(PROMPTS[:1], r)))
            lat_d.append(timed(lambda: run_diffusers(PROMPTS[0], r)))
            thr_o.append(n / timed(lambda: run_omni(PROMPTS, r)))
            thr_d.append(n / timed(lambda: [run_diffusers(p, r) for p in PROMPTS]))
    lo, ld = statistics.median(lat_o), statistics.median(lat_d)
    to, td = statistics.median(thr_o), statistics.median(thr_d)
    return [("latency, 1 request (s, lower is better)", lo, ld, f"{lo / ld:.2f}x"),
            (f"throughput, {n} concurrent (req/s, higher is better)", to, td, f"{to / td:.2f}x")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("qwen", "wan", "both"), default="both")
    parser.add_argument("--folder", help="benchmark this diffusers folder instead of a tiny random one")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--height", type=int, default=None, help="default: 64 (Qwen-Image), 32 (Wan)")
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--frames", type=int, default=9)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--mode", choices=("request", "step"), default="request",
                        help="Omni's execution mode: whole requests per wave (default) or step waves")
    args = parser.parse_args(argv)

    import torch

    load = os.getloadavg()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} torch threads on both sides (torch's default: "
          f"{os.cpu_count()} cores), device {args.device}, {args.steps} steps, {args.repeats} repeats (medians), "
          f"interleaved, Omni in {args.mode} mode; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} (1/5/15 min)")
    rows = []
    with tempfile.TemporaryDirectory() as root:
        kinds = ["qwen", "wan"] if args.model == "both" else [args.model]
        if args.folder is not None:
            from omni_core.pipelines.base import read_model_index

            kinds = ["wan" if (read_model_index(args.folder) or {}).get("_class_name") == "WanPipeline" else "qwen"]
        for kind in kinds:
            folder = args.folder or build_folder(kind, root)
            size = 64 if kind == "qwen" else 32
            a = argparse.Namespace(**{**vars(args), "height": args.height or size, "width": args.width or size})
            name = args.folder or {"qwen": "Qwen-Image (tiny)", "wan": "Wan 2.2 2-expert (tiny)"}[kind]
            shape = f"{a.height}x{a.width}" + ("" if kind == "qwen" else f"x{a.frames}f")
            for metric, omni, diff, ratio in bench(kind, folder, a):
                rows.append((f"{name} {shape}", metric, omni, diff, ratio))
    load = os.getloadavg()
    print(f"load average at the end {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} (1/5/15 min)")
    print(f"\n{'model':<34} {'metric':<52} {'omni':>9} {'diffusers':>10} {'omni/diffusers':>15}")
    for model, metric, omni, diff, ratio in rows:
        print(f"{model:<34} {metric:<52} {omni:>9.3f} {diff:>10.3f} {ratio:>15}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The diffusers backend (omni-model-diffusers) against the bare pipeline call on the same folder.

    .venv/bin/python bench/diffusers_backend.py [--rounds 9] [--steps 10] [--size 64] [--channels 64 128]

Both sides run in this process on one torch thread (Omni's in-process ``uni`` executor, ``cpu_threads=1``), from
the same folder (a Stable Diffusion UNet of ``--channels``, random weights, built in a temp dir), same prompts,
seeds, size and steps. Printed, as medians over paired rounds (each round runs both sides back to back, which goes
first alternating, so load drift on a shared machine hits them alike):

* latency: one request through ``Omni.generate`` (engine, scheduler, executor, post-processing to PIL included)
  over ``pipe(prompt, generator=...)`` with PIL output;
* batch: four requests submitted together to Omni (``max_num_seqs=4``: one call of four) over four serial bare
  calls (lower is better: the batch's gain);
* the load average before and after, since the CPU is shared.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
PROMPTS = ["a red fox in the snow", "a cat", "an astronaut riding a horse on the moon, detailed", "a bowl of fruit"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--channels", type=int, nargs=2, default=[64, 128])
    args = p.parse_args()

    import torch
    from diffusers import DiffusionPipeline

    from omni_core import Omni
    from omni_model_diffusers.testing import build_sd

    torch.set_num_threads(1)
    load0 = os.getloadavg()
    folder = build_sd(os.path.join(tempfile.mkdtemp(prefix="omni-bench-"), "sd"), tuple(args.channels))
    pipe = DiffusionPipeline.from_pretrained(folder, use_safetensors=True)
    pipe.set_progress_bar_config(disable=True)
    call = {"height": args.size, "width": args.size, "num_inference_steps": args.steps, "guidance_scale": 5.0}

    def bare(prompts: list[str]) -> float:
        t0 = time.perf_counter()
        for i, prompt in enumerate(prompts):
            pipe(prompt, generator=torch.Generator().manual_seed(i), **call)
        return time.perf_counter() - t0

    with Omni(folder, cpu_threads=1, max_num_seqs=4) as omni:
        def through_omni(prompts: list[str]) -> float:
            t0 = time.perf_counter()
            if len(prompts) == 1:
                omni.generate(prompts[0], seed=0, use_tqdm=False, **call)
            else:
                from omni_core.config import SamplingParams

                omni.generate(prompts, sampling_params=[SamplingParams(seed=i, **call) for i in range(len(prompts))],
                              use_tqdm=False)
            return time.perf_counter() - t0

        through_omni(PROMPTS[:1]), bare(PROMPTS[:1])  # first calls (allocator, kernels) are no one's cost
        latency, batch, one_bare, four_bare = [], [], [], []
        for r in range(args.rounds):
            pair = [("omni", through_omni), ("bare", bare)]
            got = {name: fn(PROMPTS[:1]) for name, fn in (pair if r % 2 == 0 else pair[::-1])}
            latency.append(got["omni"] / got["bare"])
            one_bare.append(got["bare"])
            got = {name: fn(PROMPTS) for name, fn in (pair if r % 2 == 0 else pair[::-1])}
            batch.append(got["omni"] / got["bare"])
            four_bare.append(got["bare"])
    load1 = os.getloadavg()
    print(f"SD UNet channels={tuple(args.channels)} {args.size}x{args.size} steps={args.steps} CFG on, 1 thread, "
          f"{args.rounds} paired rounds; load average {load0[0]:.2f} -> {load1[0]:.2f}")
    print(f"bare call: one request {statistics.median(one_bare) * 1000:.0f} ms, four serial "
          f"{statistics.median(four_bare) * 1000:.0f} ms")
    print(f"latency, Omni / bare call (one request):        {statistics.median(latency):.3f}x "
          f"(min {min(latency):.3f}, max {max(latency):.3f})")
    print(f"batch, Omni one call of 4 / 4 serial bare calls: {statistics.median(batch):.3f}x "
          f"(min {min(batch):.3f}, max {max(batch):.3f})")


if __name__ == "__main__":
    main()

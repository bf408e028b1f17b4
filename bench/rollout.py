"""Rollouts through Omni against the loops RL trainers run in process with diffusers' own components.

    .venv/bin/python bench/rollout.py [--rounds 5] [--steps 8] [--size 32] [--prompts 4] [--samples 8]

A tiny random-weight FLUX.1 folder (built in a temp dir), ``--prompts`` prompts x ``--samples`` samples each, every
step a Flow-GRPO ``sde`` step with its log-probability (noise level 0.7), one torch thread everywhere. The trainer's
side is diffusers' ``FluxPipeline`` call with its scheduler's ``step`` replaced by the SDE step written here (as
Flow-GRPO patches it), the log-prob of each sample and step kept; the trainer runs it

* one sample per call (``prompts x samples`` calls), and
* one call per prompt with its samples (``num_images_per_prompt``).

Omni's side: one ``generate`` of ``prompts`` requests, each ``num_outputs_per_prompt=samples`` with
``rollout={"sde_type": "sde"}`` (the engine batches them into one denoiser call per step); and the same without
``rollout`` (plain sampling) for what log-probs cost. Paired rounds (each round runs every side back to back, the
order rotating), medians printed with the load average before and after.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
PROMPTS = ["a red fox in the snow", "a cat", "an astronaut riding a horse on the moon, detailed", "a bowl of fruit",
           "two blue squares", "a lighthouse at dusk", "a green field", "a city street in the rain"]
NOISE = 0.7


def sde_step(v, x, sigma: float, sigma_next: float, sigma_max: float, generator):
    """Flow-GRPO's ``sde`` step and its per-sample log-prob, written out (the trainer's own, fp32)."""
    import torch

    v, x = v.float(), x.float()
    dt = sigma_next - sigma
    std_t = math.sqrt(sigma / (1 - (sigma_max if sigma == 1 else sigma))) * NOISE
    mean = x * (1 + std_t ** 2 / (2 * sigma) * dt) + v * (1 + std_t ** 2 * (1 - sigma) / (2 * sigma)) * dt
    std = std_t * math.sqrt(-dt)
    prev = mean + std * torch.randn(x.shape, generator=generator)
    log_prob = (-((prev - mean) ** 2) / (2 * std ** 2) - math.log(std) - 0.5 * math.log(2 * math.pi))
    return prev, log_prob.mean(dim=tuple(range(1, x.dim())))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--size", type=int, default=32)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--samples", type=int, default=8)
    args = p.parse_args()

    import torch
    from diffusers import FluxPipeline

    from omni_core import Omni
    from omni_core.config import SamplingParams
    from omni_model_flux.testing import build_tiny_flux

    torch.set_num_threads(1)
    load0 = os.getloadavg()
    folder = build_tiny_flux(os.path.join(tempfile.mkdtemp(prefix="omni-bench-"), "flux"))
    pipe = FluxPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    prompts = PROMPTS[:args.prompts]
    call = dict(height=args.size, width=args.size, num_inference_steps=args.steps, guidance_scale=3.5)
    log_probs: list = []

    def patched_step(generator):
        scheduler = pipe.scheduler

        def step(model_output, timestep, sample, return_dict=False, **_):
            i = scheduler.step_index if scheduler.step_index is not None else 0
            sigmas = scheduler.sigmas
            prev, lp = sde_step(model_output, sample, float(sigmas[i]), float(sigmas[i + 1]), float(sigmas[1]),
                                generator)
            log_probs.append(lp)
            scheduler._step_index = i + 1
            return (prev.to(sample.dtype),)
        return step

    def trainer(per_call: int) -> float:
        t0 = time.perf_counter()
        for k, prompt in enumerate(prompts):
            for j in range(0, args.samples, per_call):
                g = torch.Generator().manual_seed(1000 * k + j)
                pipe.scheduler.step = patched_step(g)
                pipe(prompt, generator=g, num_images_per_prompt=per_call, output_type="pt", **call)
        return time.perf_counter() - t0

    with Omni(folder, cpu_threads=1, max_num_seqs=args.prompts, warmup=False,
              limits={"max_outputs": max(4, args.samples)}) as omni:
        def through_omni(rollout: bool) -> float:
            params = [SamplingParams(seed=k, num_outputs_per_prompt=args.samples, output_type="pt",
                                     rollout={"sde_type": "sde", "noise_level": NOISE} if rollout else None, **call)
                      for k in range(len(prompts))]
            t0 = time.perf_counter()
            outs = omni.generate(prompts, sampling_params=params, use_tqdm=False)
            elapsed = time.perf_counter() - t0
            if rollout:
                assert all(o.rollout["log_probs"].shape == (args.samples, args.steps) for o in outs)
            return elapsed

        sides = {"omni": lambda: through_omni(True), "plain": lambda: through_omni(False),
                 "one per call": lambda: trainer(1), "per prompt": lambda: trainer(args.samples)}
        for fn in sides.values():  # first calls (allocator, kernels) are no one's cost
            fn()
        times: dict[str, list[float]] = {name: [] for name in sides}
        names = list(sides)
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                times[name].append(sides[name]())
    load1 = os.getloadavg()
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = {k: statistics.median([a / b for a, b in zip(times[k], times["omni"])]) for k in times}
    print(f"tiny FLUX.1 {args.size}x{args.size}, {args.steps} steps, {len(prompts)} prompts x {args.samples} samples, "
          f"sde with log-probs every step, 1 thread, {args.rounds} paired rounds; load average {load0[0]:.2f} -> "
          f"{load1[0]:.2f}")
    for name in names:
        print(f"  {name:<13} {med[name] * 1000:8.0f} ms")
    print(f"trainer, one sample per call / Omni:      {ratio['one per call']:.2f}x (>= 2 wanted)")
    print(f"trainer, one call per prompt / Omni:      {ratio['per prompt']:.2f}x (>= 1.0 wanted)")
    print(f"Omni with log-probs / plain sampling:     {1 / ratio['plain']:.3f}x (<= 1.05 wanted)")


if __name__ == "__main__":
    main()

"""Latency of one ``shapes`` image at the default settings, after start-up (the README's first command).

    .venv/bin/python bench/shapes_latency.py [--n 10] [--steps S] [--threads T]

Prints, side by side, the median wall time (and CPU time) of one image:

* ``Omni("shapes").generate(prompt)`` -- engine, scheduler, executor and post-processing included;
* the pipeline called directly (``forward`` on one request);
* per image when 8 requests run as one batch (``max_num_seqs=8``);
* one image with ``cpu_threads=1`` (one torch thread instead of the default: every usable core);

each against the 2 s budget. The machine's load average is printed too: on a shared machine wall times
include waiting for a core, CPU times do not.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

PROMPTS = ["a red circle in the top left", "a blue square in the center", "a green triangle in the bottom right",
           "a yellow cross in the top right", "a purple circle in the bottom left", "an orange square in the center",
           "a red triangle in the top right", "a blue cross in the bottom left"]
BUDGET_S = 2.0


def timed(fn) -> tuple[float, float]:
    w, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w, time.process_time() - c


def median_pair(samples: list[tuple[float, float]]) -> tuple[float, float]:
    return statistics.median(s[0] for s in samples), statistics.median(s[1] for s in samples)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=10, help="timed repeats per path (after one warm-up)")
    p.add_argument("--steps", type=int, default=None, help="denoising steps (default: the model's default)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = p.parse_args()

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from omni_core.config import OmniDiffusionConfig, SamplingParams
    from omni_core.entrypoints.omni import Omni
    from omni_core.pipelines import StepState, load_pipeline, resolve_model
    from omni_core.request import OmniDiffusionRequest

    kw = {"num_inference_steps": args.steps} if args.steps else {}
    rows = []

    t_start = time.perf_counter()
    with Omni("shapes") as omni:
        startup = time.perf_counter() - t_start
        omni.generate(PROMPTS[0], seed=0, use_tqdm=False, **kw)
        samples = [timed(lambda i=i: omni.generate(PROMPTS[i % 8], seed=i, use_tqdm=False, **kw))
                   for i in range(args.n)]
        rows.append(("Omni.generate, 1 image", *median_pair(samples)))
    with Omni("shapes", max_num_seqs=8) as omni:
        omni.generate(PROMPTS, seed=0, use_tqdm=False, **kw)
        samples = [timed(lambda i=i: omni.generate(PROMPTS, seed=i, use_tqdm=False, **kw))
                   for i in range(max(2, args.n // 4))]
        wall, cpu = median_pair(samples)
        rows.append(("Omni.generate, 8 in one batch, per image", wall / 8, cpu / 8))

    with Omni("shapes", cpu_threads=1) as omni:
        omni.generate(PROMPTS[0], seed=0, use_tqdm=False, **kw)
        samples = [timed(lambda i=i: omni.generate(PROMPTS[i % 8], seed=i, use_tqdm=False, **kw))
                   for i in range(args.n)]
        rows.append(("Omni.generate, 1 image, 1 torch thread", *median_pair(samples)))

    resolved = resolve_model("shapes")
    pipe = load_pipeline(resolved, OmniDiffusionConfig(model="shapes"), "cpu", torch.float32)
    cls = type(pipe)

    def direct(i: int) -> None:
        params = cls.check_sampling_params(SamplingParams(seed=i, **kw))
        req = OmniDiffusionRequest(prompt=PROMPTS[i % 8], sampling_params=params)
        with torch.inference_mode():
            (res,) = pipe.forward([StepState(request=req, generator=torch.Generator().manual_seed(i))])
        cls.post_process(res, req)

    direct(0)
    rows.append(("pipeline.forward directly, 1 image", *median_pair([timed(lambda i=i: direct(i))
                                                                    for i in range(args.n)])))

    steps = args.steps or cls.default_num_inference_steps
    print(f"shapes latency at the default settings: {cls.default_height}x{cls.default_width}, {steps} steps, "
          f"guidance {cls.default_guidance_scale} (CFG on), float32 CPU, torch threads {torch.get_num_threads()}, "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; engine start-up {startup:.1f} s")
    print(f"{'path':<44}{'wall s':>9}{'cpu s':>9}{'wall / 2 s budget':>20}")
    for name, wall, cpu in rows:
        print(f"{name:<44}{wall:>9.3f}{cpu:>9.3f}{wall / BUDGET_S:>19.2f}x")


if __name__ == "__main__":
    main()

"""``omni cache calibrate``: fit a model's TeaCache polynomial from its own uncached runs.

The model runs every step (``tea_cache`` in record mode: nothing is skipped). For every request, CFG branch
and expert, each step contributes one pair (relative L1 change of block 0's modulated input, relative L1
change of the transformer's output) against the previous step; ``numpy.polyfit`` of degree 4 over all
pairs gives the coefficients (highest power first) that ``tea_cache`` uses as ``coefficients``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

DEFAULT_PROMPTS = (
    "a red apple on a wooden table", "a cat sleeping on a sofa", "a city street at night in the rain",
    "a bowl of ramen, top view", "mountains at sunrise with a lake", "an astronaut riding a horse",
    "a watercolor painting of a lighthouse", "a close-up portrait of an old man", "a bicycle leaning on a wall",
    "a futuristic car in a desert", "a bookshelf full of colorful books", "a snowy forest path",
    "a robot cooking in a kitchen", "a field of sunflowers", "a sailing boat on a stormy sea", "a cup of coffee",
)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    cache = subparsers.add_parser("cache", help="cache backend tools (tea_cache calibration)",
                                  description="Tools of the cache backends.")
    sub = cache.add_subparsers(title="cache commands", metavar="COMMAND")
    p = sub.add_parser("calibrate", help="fit a model's TeaCache coefficients from its own uncached runs",
                       description=__doc__.split("\n\n")[1].replace("\n", " "),
                       epilog="example: omni cache calibrate --model shapes --prompts 32 --steps 50 --out shapes.json")
    p.add_argument("--model", required=True, help="model name or diffusers-format folder")
    p.add_argument("--prompts", type=int, default=16, help="number of prompts to run (default 16)")
    p.add_argument("--steps", type=int, default=None, help="denoising steps (default: the model's)")
    p.add_argument("--batch", type=int, default=4, help="requests per batched forward (default 4)")
    p.add_argument("--height", type=int, default=None)
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--num-frames", type=int, default=None, help="frames (video models)")
    p.add_argument("--seed", type=int, default=0, help="seed of the first prompt (others count up)")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    p.add_argument("--degree", type=int, default=4, help="polynomial degree (default 4, as TeaCache)")
    p.add_argument("--out", default=None, help="write the result as JSON to this file")
    p.set_defaults(func=run_calibrate)
    cache.set_defaults(func=lambda args: cache.print_help() or 2)


def model_prompts(pipeline: Any, n: int) -> list[str]:
    """``n`` prompts the model understands: the shapes model's own scenes, generic prompts otherwise."""
    if type(pipeline).__name__ == "ShapesPipeline":
        from omni_model_shapes import data

        scenes = data.all_scenes()
        step = max(1, len(scenes) // max(n, 1))
        return [scenes[(i * step + i // len(scenes)) % len(scenes)].prompt for i in range(n)]
    return [DEFAULT_PROMPTS[i % len(DEFAULT_PROMPTS)] for i in range(n)]


def collect(pipeline: Any, prompts: list[str], *, model_path: str | None = None, steps: int | None = None,
            batch: int = 4, seed: int = 0, **sampling: Any) -> dict[str, list[tuple[float, float]]]:
    """Run ``prompts`` uncached through ``pipeline`` (a loaded Omni pipeline); returns
    ``{"branch/expert": [(input change, output change), ...]}``."""
    import torch

    from omni_cache_teacache.backend import TeaCacheBackend, TeaState
    from omni_core.config import SamplingParams
    from omni_core.pipelines.state import StepState
    from omni_core.request import OmniDiffusionRequest

    backend = TeaCacheBackend({})
    backend.record = True
    backend.enable(pipeline)
    pairs: dict[str, list[tuple[float, float]]] = {}
    try:
        for lo in range(0, len(prompts), batch):
            states = []
            for k, prompt in enumerate(prompts[lo:lo + batch]):
                params = SamplingParams(num_inference_steps=steps, seed=seed + lo + k,
                                        **{key: v for key, v in sampling.items() if v is not None})
                params = type(pipeline).check_sampling_params(params, model_path)
                req = OmniDiffusionRequest(prompt=prompt, sampling_params=params,
                                           negative_prompt=sampling_negative(pipeline))
                gen = torch.Generator(device=getattr(pipeline, "device", "cpu")).manual_seed(params.seed)
                states.append(StepState(request=req, generator=gen))

            class _Control:
                def stopped(self, ids):
                    return set()

                def on_encoded(self, state):
                    backend.begin_request(state)

                def on_step(self, state):
                    pass

            with torch.inference_mode():
                pipeline.forward(states, _Control())
            for state in states:
                for key, tea in state.cache_state.items():
                    if isinstance(tea, TeaState) and tea.records:
                        label = "/".join(str(p) for p in key)
                        pairs.setdefault(label, []).extend((r[1], r[2]) for r in tea.records)
    finally:
        backend.disable(pipeline)
    return pairs


def sampling_negative(pipeline: Any) -> str | None:
    """A negative prompt so CFG branches run (Qwen-Image's true CFG needs one)."""
    return "" if type(pipeline).__name__ == "ShapesPipeline" else "blurry, low quality"


def fit(pairs: list[tuple[float, float]], degree: int = 4) -> list[float]:
    import numpy as np

    x = np.array([p[0] for p in pairs], dtype=np.float64)
    y = np.array([p[1] for p in pairs], dtype=np.float64)
    return [float(c) for c in np.polyfit(x, y, degree)]


def run_calibrate(args: argparse.Namespace) -> int:
    import numpy as np

    from omni_core.config import OmniDiffusionConfig
    from omni_core.errors import ConfigError
    from omni_core.pipelines import load_pipeline, resolve_model
    from omni_core.platforms import current_platform
    from omni_core.worker.runner import torch_dtype

    if args.prompts < 1 or args.batch < 1 or (args.steps is not None and args.steps < 3):
        raise ConfigError("--prompts and --batch must be >= 1 and --steps >= 3", field="prompts")
    config = OmniDiffusionConfig(model=args.model, dtype=args.dtype)
    resolved = resolve_model(args.model)
    device = current_platform.get_torch_device(0)
    pipeline = load_pipeline(resolved, config, device, torch_dtype(config, current_platform))
    prompts = model_prompts(pipeline, args.prompts)
    pairs = collect(pipeline, prompts, model_path=resolved.model_path, steps=args.steps, batch=args.batch, seed=args.seed, height=args.height,
                    width=args.width, num_frames=args.num_frames)
    every = [p for ps in pairs.values() for p in ps]
    if len(every) <= args.degree:
        raise ConfigError(f"only {len(every)} step pairs were recorded; run more prompts or steps", field="prompts")
    coeffs = fit(every, args.degree)
    x = np.array([p[0] for p in every])
    y = np.array([p[1] for p in every])
    pred = np.polyval(coeffs, x)
    r2 = 1 - float(((y - pred) ** 2).sum() / max(((y - y.mean()) ** 2).sum(), 1e-30))
    result = {"model": args.model, "denoiser": type(next(iter(_denoisers(pipeline).values()))).__name__,
              "coefficients": coeffs, "degree": args.degree, "num_pairs": len(every), "r2": r2,
              "prompts": len(prompts), "steps": args.steps,
              "per_branch": {k: fit(v, args.degree) if len(v) > args.degree else None for k, v in pairs.items()},
              "input_change_range": [float(x.min()), float(x.max())]}
    print(f"model: {args.model} ({result['denoiser']}), {len(every)} step pairs from {len(prompts)} prompts")
    print(f"input change range: {x.min():.4g} .. {x.max():.4g}; fit R^2 = {r2:.3f}")
    print("coefficients: [" + ", ".join(f"{c:.8e}" for c in coeffs) + "]")
    print(f"use: cache_backend='tea_cache', cache_config={{'coefficients': [...], 'rel_l1_thresh': ...}}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


def _denoisers(pipeline: Any) -> dict:
    from omni_cache_teacache.backend import denoisers

    return denoisers(pipeline)

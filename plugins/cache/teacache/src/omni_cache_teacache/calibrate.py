"""``omni cache calibrate``: fit a model's TeaCache polynomial from its own uncached runs.

The model runs every step (``tea_cache`` in record mode: nothing is skipped). For every request, CFG branch
and expert, each step contributes one pair (relative L1 change of block 0's modulated input, relative L1
change of the transformer's output) against the previous step; ``numpy.polyfit`` of degree 4 over all
pairs gives the coefficients (highest power first) that ``tea_cache`` uses as ``coefficients``.

It works for any model whose pipeline declares a ``DenoiserSpec`` with ``modulated_input``; prompts come from
the pipeline's ``example_prompts()``. The fit is printed as the ``cache_defaults`` entry to paste into the spec,
and ``--write`` stores it in the model folder's ``cache_defaults.json``, which ``tea_cache`` reads as the
model's shipped defaults (over the spec's, under the user's ``cache_config``).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

def add_parser(subparsers: argparse._SubParsersAction) -> None:
    cache = subparsers.add_parser("cache", help="cache backend tools (tea_cache calibration)",
                                  description="Tools of the cache backends.")
    sub = cache.add_subparsers(title="cache commands", metavar="COMMAND")
    p = sub.add_parser("calibrate", help="fit a model's TeaCache coefficients from its own uncached runs",
                       description=__doc__.split("\n\n")[1].replace("\n", " "),
                       epilog="example: omni cache calibrate --model /models/my-model --prompts 32 --steps 50 --write")
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
    p.add_argument("--negative-prompt", default="", help="negative prompt, so both CFG branches run (default \"\")")
    p.add_argument("--out", default=None, help="write the result as JSON to this file")
    p.add_argument("--write", action="store_true",
                   help="store the coefficients in the model folder's cache_defaults.json (the model's shipped "
                        "tea_cache defaults)")
    p.add_argument("--rel-l1-thresh", type=float, default=None,
                   help="with --write: also store this threshold as the model's default")
    p.set_defaults(func=run_calibrate)
    cache.set_defaults(func=lambda args: cache.print_help() or 2)


def model_prompts(pipeline: Any, n: int) -> list[str]:
    """``n`` prompts the model handles well: its pipeline's ``example_prompts()``, repeated as needed."""
    offered = list(type(pipeline).example_prompts())
    if not offered:
        from omni_core.errors import ConfigError

        raise ConfigError(f"{type(pipeline).__name__}.example_prompts() offers no prompts to calibrate with",
                          field="example_prompts")
    return [offered[i % len(offered)] for i in range(n)]


def collect(pipeline: Any, prompts: list[str], *, model_path: str | None = None, steps: int | None = None,
            batch: int = 4, seed: int = 0, negative_prompt: str | None = "",
            **sampling: Any) -> dict[str, list[tuple[float, float]]]:
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
                                           negative_prompt=negative_prompt)
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
    from omni_core.pipelines.denoiser import denoisers_of
    from omni_core.utils.dtypes import torch_dtype

    if args.prompts < 1 or args.batch < 1 or (args.steps is not None and args.steps < 3):
        raise ConfigError("--prompts and --batch must be >= 1 and --steps >= 3", field="prompts")
    config = OmniDiffusionConfig(model=args.model, dtype=args.dtype)
    resolved = resolve_model(args.model)
    device = current_platform.get_torch_device(0)
    pipeline = load_pipeline(resolved, config, device, torch_dtype(config, current_platform))
    prompts = model_prompts(pipeline, args.prompts)
    pairs = collect(pipeline, prompts, model_path=resolved.model_path, steps=args.steps, batch=args.batch,
                    seed=args.seed, negative_prompt=args.negative_prompt, height=args.height, width=args.width,
                    num_frames=args.num_frames)
    every = [p for ps in pairs.values() for p in ps]
    if len(every) <= args.degree:
        raise ConfigError(f"only {len(every)} step pairs were recorded; run more prompts or steps", field="prompts")
    coeffs = fit(every, args.degree)
    x = np.array([p[0] for p in every])
    y = np.array([p[1] for p in every])
    pred = np.polyval(coeffs, x)
    r2 = 1 - float(((y - pred) ** 2).sum() / max(((y - y.mean()) ** 2).sum(), 1e-30))
    specs = denoisers_of(pipeline)
    result = {"model": args.model, "denoiser": type(specs[0].module).__name__,
              "denoisers": [s.name for s in specs],
              "coefficients": coeffs, "degree": args.degree, "num_pairs": len(every), "r2": r2,
              "prompts": len(prompts), "steps": args.steps,
              "per_branch": {k: fit(v, args.degree) if len(v) > args.degree else None for k, v in pairs.items()},
              "input_change_range": [float(x.min()), float(x.max())]}
    print(f"model: {args.model} ({result['denoiser']}), {len(every)} step pairs from {len(prompts)} prompts")
    print(f"input change range: {x.min():.4g} .. {x.max():.4g}; fit R^2 = {r2:.3f}")
    print("coefficients: [" + ", ".join(f"{c:.8e}" for c in coeffs) + "]")
    print("use: cache_backend='tea_cache', cache_config={'coefficients': [...], 'rel_l1_thresh': ...}")
    print("or ship it in the model's DenoiserSpec: " + spec_snippet(coeffs, args.rel_l1_thresh))
    if args.write:
        path = write_shipped_defaults(resolved.model_path, coeffs, args.rel_l1_thresh)
        print(f"wrote {path} (tea_cache reads it as the model's shipped defaults)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


def spec_snippet(coeffs: list[float], thresh: float | None = None) -> str:
    """The ``cache_defaults`` argument of a ``DenoiserSpec`` that ships these coefficients."""
    entry = "'coefficients': (" + ", ".join(f"{c:.8e}" for c in coeffs) + ")"
    if thresh is not None:
        entry += f", 'rel_l1_thresh': {thresh!r}"
    return "cache_defaults={'tea_cache': {" + entry + "}}"


def write_shipped_defaults(model_path: str, coeffs: list[float], thresh: float | None = None) -> str:
    """Merge the coefficients (and threshold) into ``<model_path>/cache_defaults.json``; other backends' entries
    and other tea_cache keys stay. Returns the file's path."""
    import os

    from omni_core.pipelines.denoiser import CACHE_DEFAULTS_FILE, shipped_cache_defaults

    path = os.path.join(model_path, CACHE_DEFAULTS_FILE)
    data: dict[str, Any] = {}
    if os.path.isfile(path):
        shipped_cache_defaults(model_path)  # refuses a malformed file instead of overwriting it
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    entry = dict(data.get("tea_cache", {}))
    entry["coefficients"] = [float(c) for c in coeffs]
    if thresh is not None:
        entry["rel_l1_thresh"] = float(thresh)
    data["tea_cache"] = entry
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
    return path

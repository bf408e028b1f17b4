"""Score prompt adherence of the shapes model: ``python -m omni_model_shapes.evaluate [--n N] [--steps S] [--json]``.

Generates one image per prompt for every colour x shape x position combination (cycled to ``--n``
images, each with its own seed), judges each with exact geometric checks (:mod:`omni_model_shapes.judge`)
and reports colour, shape and position accuracy. Also writes a sample grid (one row per colour, one
column per shape x position). Generation goes through ``Omni`` (the engine), or straight through the
pipeline's step-wise protocol with ``--via pipeline``; both give the same images for the same seeds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import torch

from omni_model_shapes import data, judge

DEFAULT_N = 240
DEFAULT_GRID = os.path.join("docs", "images", "shapes_grid.png")


def eval_scenes(n: int) -> list[data.Scene]:
    """``n`` scenes cycling through all 120 combinations (so n >= 120 covers every one)."""
    scenes = data.all_scenes()
    return [scenes[i % len(scenes)] for i in range(n)]


def generate_with_pipeline(pipeline: Any, prompts: list[str], seeds: list[int], *, steps: int | None = None,
                           guidance_scale: float | None = None, batch_size: int = 24) -> torch.Tensor:
    """Images ``[N, 3, H, W]`` from a loaded ``ShapesPipeline`` via ``forward`` (request batches)."""
    from omni_core.config import SamplingParams
    from omni_core.pipelines import StepState
    from omni_core.request import OmniDiffusionRequest

    out = []
    for start in range(0, len(prompts), batch_size):
        states = []
        for prompt, seed in zip(prompts[start:start + batch_size], seeds[start:start + batch_size]):
            params = type(pipeline).check_sampling_params(SamplingParams(
                seed=seed, num_inference_steps=steps, guidance_scale=guidance_scale, output_type="pt"))
            states.append(StepState(request=OmniDiffusionRequest(prompt=prompt, sampling_params=params),
                                    generator=torch.Generator("cpu").manual_seed(seed)))
        out += [o.tensor[0] for o in pipeline.forward(states)]
    return torch.stack(out)


def generate_with_omni(model: str, prompts: list[str], seeds: list[int], *, steps: int | None = None,
                       guidance_scale: float | None = None, batch_size: int = 24) -> torch.Tensor:
    """Images ``[N, 3, H, W]`` through the engine (``Omni``), requests batched up to ``batch_size``."""
    from omni_core.config import SamplingParams
    from omni_core.entrypoints.omni import Omni
    from omni_core.request import OmniDiffusionRequest

    with Omni(model, max_num_seqs=batch_size) as omni:
        streams = []
        for prompt, seed in zip(prompts, seeds):
            params = SamplingParams(seed=seed, num_inference_steps=steps, guidance_scale=guidance_scale,
                                    output_type="pt")
            streams.extend(omni.engine.submit([OmniDiffusionRequest(prompt=prompt, sampling_params=params)]))
        images = []
        for stream in streams:
            while not (out := stream.get()).finished:
                pass
            if out.status != "completed":
                raise RuntimeError(f"request {out.request_id} {out.status}: {out.error}")
            images.append(out.images[0])
    return torch.stack(images)


def save_grid(images: torch.Tensor, path: str, columns: int, scale: int = 4, pad: int = 2) -> None:
    """Tile ``images`` ([N, 3, H, W] in [0, 1]) ``columns`` per row, upscaled ``scale``x, white gutters."""
    from PIL import Image

    n, _, h, w = images.shape
    rows = (n + columns - 1) // columns
    hh, ww = h * scale + pad, w * scale + pad
    canvas = torch.ones(3, rows * hh + pad, columns * ww + pad)
    big = images.repeat_interleave(scale, 2).repeat_interleave(scale, 3)
    for i in range(n):
        r, c = divmod(i, columns)
        canvas[:, pad + r * hh: pad + r * hh + h * scale, pad + c * ww: pad + c * ww + w * scale] = big[i]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    arr = (canvas.clamp(0, 1) * 255).round().byte().permute(1, 2, 0).numpy()
    Image.fromarray(arr).save(path)


def evaluate(model: str = "shapes", n: int = DEFAULT_N, steps: int | None = None, guidance_scale: float | None = None,
             seed: int = 0, via: str = "omni", pipeline: Any = None, batch_size: int = 24,
             grid: str | None = DEFAULT_GRID) -> dict:
    """Generate ``n`` images and score them; returns the figures (and writes the grid if ``grid``)."""
    scenes = eval_scenes(n)
    prompts = [s.prompt for s in scenes]
    seeds = [seed + i for i in range(n)]
    t0 = time.perf_counter()
    if pipeline is not None or via == "pipeline":
        if pipeline is None:
            from omni_core.config import OmniDiffusionConfig
            from omni_core.pipelines import load_pipeline, resolve_model

            pipeline = load_pipeline(resolve_model(model), OmniDiffusionConfig(model=model), "cpu", torch.float32)
        images = generate_with_pipeline(pipeline, prompts, seeds, steps=steps, guidance_scale=guidance_scale,
                                        batch_size=batch_size)
        cls = type(pipeline)
    elif via == "omni":
        images = generate_with_omni(model, prompts, seeds, steps=steps, guidance_scale=guidance_scale,
                                    batch_size=batch_size)
        from omni_model_shapes.pipeline import ShapesPipeline as cls
    else:
        raise ValueError(f"via must be 'omni' or 'pipeline', got {via!r}")
    gen_s = time.perf_counter() - t0
    scores, judgements = judge.score(images, scenes)
    result = {
        "model": model, "n": n, "steps": steps or cls.default_num_inference_steps,
        "guidance_scale": guidance_scale if guidance_scale is not None else cls.default_guidance_scale,
        "seed": seed, "via": "pipeline" if pipeline is not None else via,
        "chance": {"colour": round(1 / len(data.COLOURS), 4), "shape": round(1 / len(data.SHAPES), 4),
                   "position": round(1 / len(data.POSITIONS), 4)},
        **scores.as_dict(), "generation_s": round(gen_s, 1),
        "per_attribute": _per_attribute(scenes, judgements),
    }
    if grid:
        # first 120 images = every combination once: rows are colours, columns shape x position
        k = min(n, len(data.all_scenes()))
        save_grid(images[:k], grid, columns=len(data.SHAPES) * len(data.POSITIONS))
        result["grid"] = grid
    return result


def _per_attribute(scenes: list[data.Scene], judgements: list[judge.Judgement]) -> dict:
    """Accuracy of each attribute broken down by its true value (where the model struggles)."""
    out: dict[str, dict[str, float]] = {}
    for attr in ("colour", "shape", "position"):
        totals: dict[str, list[int]] = {}
        for s, j in zip(scenes, judgements):
            t = totals.setdefault(getattr(s, attr), [0, 0])
            t[0] += getattr(j, attr) == getattr(s, attr)
            t[1] += 1
        out[attr] = {k: round(v[0] / v[1], 3) for k, v in totals.items()}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m omni_model_shapes.evaluate", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="shapes", help="model name or folder (default: the shipped 'shapes')")
    parser.add_argument("--n", type=int, default=DEFAULT_N, help=f"number of images (default {DEFAULT_N}; >= 120 "
                        "covers every colour x shape x position combination)")
    parser.add_argument("--steps", type=int, default=None, help="denoising steps (default: the model's default)")
    parser.add_argument("--guidance", type=float, default=None, help="guidance scale (default: the model's)")
    parser.add_argument("--seed", type=int, default=0, help="image i uses seed SEED + i")
    parser.add_argument("--via", choices=("omni", "pipeline"), default="omni")
    parser.add_argument("--batch-size", type=int, default=24)
    parser.add_argument("--grid", default=None, help=f"sample grid PNG path (default {DEFAULT_GRID}, none with "
                        "--random-weights; '' to skip)")
    parser.add_argument("--random-weights", action="store_true", help="score a model of the shipped architecture "
                        "with random weights instead (the baseline: should be near chance)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    if args.n < 1:
        parser.error("--n must be at least 1")
    if args.grid is None:
        args.grid = "" if args.random_weights else DEFAULT_GRID
    if args.random_weights:
        import tempfile

        from omni_model_shapes.testing import build_random_shapes, shipped_config

        with tempfile.TemporaryDirectory() as tmp:
            folder = build_random_shapes(os.path.join(tmp, "random-shapes"), shipped_config(), seed=args.seed)
            result = evaluate(folder, args.n, args.steps, args.guidance, args.seed, args.via,
                              batch_size=args.batch_size, grid=args.grid or None)
            result["model"] = "random weights (shipped architecture)"
    else:
        result = evaluate(args.model, args.n, args.steps, args.guidance, args.seed, args.via,
                          batch_size=args.batch_size, grid=args.grid or None)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"shapes evaluation: {result['n']} images, {result['steps']} steps, guidance {result['guidance_scale']}"
              f" (via {result['via']}, {result['generation_s']} s)")
        for attr in ("colour", "shape", "position"):
            print(f"  {attr:<9} accuracy {result[attr]:.1%}  (chance {result['chance'][attr]:.1%})")
        print(f"  all three  {result['all']:.1%}   mean template IoU {result['mean_iou']:.3f}")
        if result.get("grid"):
            print(f"  grid: {result['grid']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

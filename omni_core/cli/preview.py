"""``omni preview calibrate``: fit a model's latent-to-RGB preview projection from its own runs.

A few prompts (the pipeline's ``example_prompts()``) run step by step; after 1/4, 1/2, 3/4 and all of the steps
the step's clean estimate is decoded by the model's VAE (as its final image would be) and area-averaged to the
latent grid. Least squares over every latent pixel gives ``rgb = W @ latent + b`` (``W``: 3 x C), or the same
over each pixel's 3x3 or 5x5 neighbourhood when that predicts held-out prompts clearly better (tiny random
VAEs). ``--write`` stores it in the model folder's ``preview_projection.json``, which previews then use.
"""

from __future__ import annotations

import argparse
import json
import sys


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    preview = subparsers.add_parser("preview", help="preview tools (fit a model's latent-to-RGB projection)",
                                    description="Tools for streamed previews. See docs/previews.md.")
    sub = preview.add_subparsers(title="preview commands", metavar="COMMAND")
    p = sub.add_parser("calibrate", help="fit a model's latent-to-RGB preview projection from its own runs",
                       description=__doc__.split("\n\n")[1].replace("\n", " "),
                       epilog="example: omni preview calibrate --model /models/my-model --steps 20 --write")
    p.add_argument("--model", required=True, help="model name or diffusers-format folder")
    p.add_argument("--prompts", type=int, default=4, help="prompts to run (4 VAE decodes each; default 4)")
    p.add_argument("--steps", type=int, default=None, help="denoising steps (default: the model's)")
    p.add_argument("--height", type=int, default=None)
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--num-frames", type=int, default=None, help="frames (video models)")
    p.add_argument("--seed", type=int, default=0, help="seed of the first prompt (others count up)")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    p.add_argument("--kernel", default="auto", choices=["auto", "1", "3", "5"],
                   help="neighbourhood of the projection: 1 = a plain 3 x C matrix; auto (default) picks 1, 3 or 5 "
                        "on held-out prompts")
    p.add_argument("--write", action="store_true",
                   help="store the projection in the model folder's preview_projection.json (previews use it)")
    p.add_argument("--out", default=None, help="also write the result as JSON to this file")
    p.set_defaults(func=run_calibrate)
    preview.set_defaults(func=lambda args: preview.print_help() or 2)


def calibrate(pipeline, *, model_path: str | None, prompts: int = 4, steps: int | None = None, seed: int = 0,
              kernel: str | int = "auto", sampling: dict | None = None) -> tuple:
    """Fit on a loaded pipeline; returns ``(projection, report)``; ``report`` has the PSNR (dB, over the
    calibration decodes) of the projection, of the plain channel preview of the noisy latents (the preview
    before projections) and of the shipped projection, if one matches."""
    import time

    from omni_core.errors import ConfigError
    from omni_core.pipelines.preview import channel_preview, find_projection
    from omni_core.pipelines.preview_fit import choose_kernel, collect_pairs, fit_projection, projection_psnr, psnr

    offered = list(type(pipeline).example_prompts())
    if not offered:
        raise ConfigError(f"{type(pipeline).__name__}.example_prompts() offers no prompts to calibrate with",
                          field="example_prompts")
    if prompts < 1 or (steps is not None and steps < 1):
        raise ConfigError("--prompts and --steps must be >= 1", field="prompts")
    t0 = time.perf_counter()
    records = collect_pairs(pipeline, [offered[i % len(offered)] for i in range(prompts)], model_path=model_path,
                            steps=steps, seed=seed, sampling=sampling)
    scores: dict = {}
    if kernel == "auto":
        kernel, scores = choose_kernel(records)
    kernel = int(kernel)
    source = (f"fitted by omni preview calibrate: {len(records)} VAE decodes of clean estimates, {prompts} prompts, "
              f"{records[0]['num_steps']} steps, kernel {kernel}")
    proj = fit_projection(((r["latents"], r["target"]) for r in records), kernel=kernel, source=source)

    def middle(t):
        return t[:, t.shape[1] // 2] if t.dim() == 4 else t

    vae_cfg = pipeline.preview_vae_config() if hasattr(pipeline, "preview_vae_config") else {}
    shipped, _ = find_projection(type(pipeline), None, proj.channels, vae_cfg)
    report = {
        "channels": proj.channels, "kernel": kernel, "decodes": len(records), "seconds": time.perf_counter() - t0,
        "psnr_projection": projection_psnr(proj, records),
        "psnr_channel_preview": sum(psnr(channel_preview(r["current"]), middle(r["target"])) for r in records)
        / len(records),
        "psnr_shipped": projection_psnr(shipped, records) if shipped is not None else None,
        "held_out_psnr_by_kernel": {str(k): v for k, v in scores.items()},
    }
    return proj, report


def run_calibrate(args: argparse.Namespace) -> int:
    from omni_core.config import OmniDiffusionConfig
    from omni_core.pipelines import load_pipeline, resolve_model
    from omni_core.pipelines.preview import write_projection
    from omni_core.platforms import current_platform
    from omni_core.utils.dtypes import torch_dtype

    config = OmniDiffusionConfig(model=args.model, dtype=args.dtype)
    resolved = resolve_model(args.model)
    device = current_platform.get_torch_device(0)
    pipeline = load_pipeline(resolved, config, device, torch_dtype(config, current_platform))
    proj, report = calibrate(pipeline, model_path=resolved.model_path, prompts=args.prompts, steps=args.steps,
                             seed=args.seed, kernel=args.kernel,
                             sampling={"height": args.height, "width": args.width, "num_frames": args.num_frames})
    print(f"model: {args.model} ({type(pipeline).__name__}), {report['channels']} latent channels; "
          f"{report['decodes']} decodes in {report['seconds']:.1f} s")
    if report["held_out_psnr_by_kernel"]:
        print("held-out PSNR by kernel: " + ", ".join(f"{k}x{k}: {v:.1f} dB"
                                                      for k, v in report["held_out_psnr_by_kernel"].items()))
    print(f"PSNR against the VAE decode of each clean estimate: projection ({report['kernel']}x{report['kernel']}) "
          f"{report['psnr_projection']:.1f} dB; channel preview {report['psnr_channel_preview']:.1f} dB"
          + (f"; shipped projection {report['psnr_shipped']:.1f} dB" if report["psnr_shipped"] is not None else ""))
    if args.write:
        path = write_projection(resolved.model_path, proj, fit=report)
        print(f"wrote {path} (previews of this model use it)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**proj.to_json(), "fit": report}, f, indent=2)
        print(f"wrote {args.out}", file=sys.stderr)
    return 0

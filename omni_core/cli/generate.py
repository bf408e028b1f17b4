"""``omni generate``: one prompt in, one image (PNG) or video (MP4/GIF) file out."""

from __future__ import annotations

import argparse
import os
import time

from omni_core.cli.options import add_engine_options, engine_options
from omni_core.errors import ConfigError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "generate", help="generate an image or video from a prompt and write it to a file",
        description="Generate from a prompt with any installed model and write the result. Without --model it "
                    "uses the built-in 'shapes' demo model.",
        epilog='example: omni generate --prompt "a red circle in the top left" --out circle.png')
    p.add_argument("--prompt", required=True)
    p.add_argument("--negative-prompt", default=None)
    p.add_argument("--model", default="shapes", help="model name or diffusers-format folder (default: shapes)")
    p.add_argument("--steps", type=int, default=None, help="denoising steps (default: the model's)")
    p.add_argument("--seed", type=int, default=None, help="random seed (default: random, printed)")
    p.add_argument("--guidance", type=float, default=None, help="guidance scale (default: the model's)")
    p.add_argument("--true-cfg-scale", type=float, default=None, help="true CFG scale (Qwen-Image)")
    p.add_argument("--height", type=int, default=None)
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--num-frames", type=int, default=None, help="frames (video models)")
    p.add_argument("--n", type=int, default=1, help="outputs for the prompt (files get a -K suffix)")
    p.add_argument("--out", default=None, help="output file (default: out.png, or out.mp4 for video)")
    p.add_argument("--fps", type=int, default=16, help="frames per second of a video file")
    p.add_argument("--native-size", action="store_true",
                   help="write images at the model's size (by default small images are upscaled for display)")
    p.add_argument("--no-warmup", action="store_true",
                   help="skip the start-up warm-up (one step at the smallest valid shape)")
    add_engine_options(p)
    p.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    from omni_core.entrypoints.omni import Omni
    from omni_core.utils.media import VIDEO_SUFFIXES, upscale_for_display, write_video

    sampling = {"num_inference_steps": args.steps, "seed": args.seed, "guidance_scale": args.guidance,
                "true_cfg_scale": args.true_cfg_scale, "height": args.height, "width": args.width,
                "num_frames": args.num_frames, "num_outputs_per_prompt": args.n}
    sampling = {k: v for k, v in sampling.items() if v is not None}
    prompt = {"prompt": args.prompt, "negative_prompt": args.negative_prompt}
    t0 = time.perf_counter()
    with Omni(args.model, warmup=not args.no_warmup, **engine_options(args)) as omni:
        t1 = time.perf_counter()
        (out,) = omni.generate(prompt, **sampling)
        t2 = time.perf_counter()
    is_video = bool(out.images) and isinstance(out.images[0], list)
    path = args.out or ("out.mp4" if is_video else "out.png")
    root, suffix = os.path.splitext(path)
    if is_video and suffix.lower() not in VIDEO_SUFFIXES:
        raise ConfigError(f"--out {path!r}: a video needs one of {', '.join(VIDEO_SUFFIXES)}", field="out")
    written = []
    for k, item in enumerate(out.images):
        target = path if len(out.images) == 1 else f"{root}-{k}{suffix}"
        if is_video:
            write_video(item, target, fps=args.fps)
            desc = f"{len(item)} frames {item[0].width}x{item[0].height}"
        else:
            shown = item if args.native_size else upscale_for_display(item)
            shown.save(target)
            desc = f"{item.width}x{item.height}" + ("" if shown is item else f", shown at {shown.width}x{shown.height}")
        written.append(f"{target} ({desc})")
    print(f"wrote {', '.join(written)}")
    print(f"model={args.model} seed={out.metrics.get('seed')} steps={out.metrics.get('steps_run')} "
          f"generate={t2 - t1:.2f}s start-up={t1 - t0:.2f}s")
    return 0

"""``omni generate``: one prompt in, one image (PNG) or video (MP4/GIF) file out."""

from __future__ import annotations

import argparse
import os

import attrs
import time
from typing import Any

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
    p.add_argument("--image", action="append", default=None, metavar="PATH",
                   help="an input image for edit and image-to-video models (repeat for models that take several)")
    p.add_argument("--model", default="shapes", help="model name or diffusers-format folder (default: shapes)")
    p.add_argument("--steps", type=int, default=None, help="denoising steps (default: the model's)")
    p.add_argument("--seed", type=int, default=None, help="random seed (default: random, printed)")
    p.add_argument("--guidance", type=float, default=None, help="guidance scale (default: the model's)")
    p.add_argument("--height", type=int, default=None)
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--num-frames", type=int, default=None, help="frames (video models)")
    p.add_argument("--n", type=int, default=1, help="outputs for the prompt (files get a -K suffix)")
    p.add_argument("--out", default=None, help="output file (default: out.png, or out.mp4 for video)")
    p.add_argument("--fps", type=int, default=None,
                   help="frames per second of a video (default: the model's frame rate where its frames have one of "
                        "their own, and it sets it; else 16, for the file only)")
    p.add_argument("--native-size", action="store_true",
                   help="write images at the model's size (by default small images are upscaled for display)")
    p.add_argument("--no-warmup", action="store_true",
                   help="skip the start-up warm-up (one step at the smallest valid shape)")
    model = p.add_argument_group("model sampling fields", "declared by the installed models; a model refuses "
                                                           "another model's field")
    add_engine_options(p)
    from omni_core.cli.lora import add_lora_options

    add_lora_options(p.add_argument_group("LoRA adapter (docs/lora.md)"), per_request=True)
    p.set_defaults(func=run_generate, model_fields=add_model_field_options(model))


def add_model_field_options(group: argparse._ArgumentGroup) -> list[tuple[str, str]]:
    """One option per sampling field the registered pipelines declare (``shift_scale`` ->
    ``--shift-scale``), read from their records. Returns ``[(field name, argparse dest)]``."""
    from omni_core.config import registered_sampling_fields

    added = []
    for name, decls in registered_sampling_fields().items():
        field = decls[0][1]
        # each owner with its own default (FLUX's true_cfg_scale defaults to 1.0, Qwen-Image's to 4.0)
        owners = "; ".join(pipeline + ("" if f.default is None else f": default {f.default}") for pipeline, f in decls)
        default = ""
        helps = {f.help for _, f in decls}
        if len(helps) > 1:  # declared by several models in their own words
            field = attrs.evolve(field, help=f"a sampling field of several models: {' / '.join(sorted(h for h in helps if h))}")
        extra = field.cli_kwargs()
        dest = f"model_field_{name}"
        try:
            group.add_argument(field.flag, dest=dest, default=None, help=f"{field.help} ({owners}{default})".lstrip(),
                               **extra)
        except argparse.ArgumentError:  # the command's own options (added first) win a clash
            continue
        added.append((name, dest))
    return added


def open_image(path: str):
    """``--image PATH`` as a decoded PIL image, or a ``ConfigError`` naming ``image``."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            image.load()
            return image.copy()
    except FileNotFoundError:
        raise ConfigError(f"--image {path!r}: no such file", field="image") from None
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise ConfigError(f"--image {path!r} is not an image PIL can read ({exc})", field="image") from None


#: SamplingParams field -> the option that sets it (errors name what the user typed)
FLAG_OF_FIELD = {"height": "--height", "width": "--width", "num_frames": "--num-frames",
                 "num_inference_steps": "--steps", "guidance_scale": "--guidance", "seed": "--seed",
                 "num_outputs_per_prompt": "--n", "lora_scale": "--lora-scale"}


def run_generate(args: argparse.Namespace) -> int:
    from omni_core.utils import progress as stages

    with stages.shown("omni generate"):  # start-up progress on stderr, one line per stage
        return _generate(args)


def video_fps(args: argparse.Namespace, spec: Any, sampling: dict[str, Any]) -> int | float:
    """The rate the video's frames play at: a model whose frames have their own (``PipelineSpec.fps_field``, LTX-2's
    ``frame_rate``) takes ``--fps`` as that field (``sampling`` gets it) and defaults to the field's default; for
    the others ``--fps`` only says how the file is written (default 16)."""
    name = spec.fps_field
    if name is None:
        return args.fps or 16
    own, flag = sampling.get(name), "--" + name.replace("_", "-")
    if args.fps is not None and own is not None and args.fps != own:
        raise ConfigError(f"--fps {args.fps} and {flag} {own} disagree: {args.model}'s frames play at its {name}; "
                          f"give one of them", field="fps")
    if args.fps is not None:
        sampling[name] = args.fps
    default = next((f.default for f in spec.sampling_fields if f.name == name), None)
    return sampling.get(name) or default or 16


def _generate(args: argparse.Namespace) -> int:
    from omni_core.entrypoints.omni import Omni
    from omni_core.pipelines.shape_check import check_before_loading
    from omni_core.utils.media import AUDIO_CODECS, VIDEO_SUFFIXES, upscale_for_display, write_video
    from omni_core.utils.progress import progress

    sampling = {"num_inference_steps": args.steps, "seed": args.seed, "guidance_scale": args.guidance,
                "height": args.height, "width": args.width, "num_frames": args.num_frames,
                "num_outputs_per_prompt": args.n, **{name: getattr(args, dest) for name, dest in args.model_fields}}
    from omni_core.cli.lora import lora_options

    lora_opts, sampling["lora"] = lora_options(args)
    sampling["lora_scale"] = args.lora_scale
    sampling = {k: v for k, v in sampling.items() if v is not None}
    prompt = {"prompt": args.prompt, "negative_prompt": args.negative_prompt}
    t0 = time.perf_counter()
    # what needs no model is refused before it loads (importing torch and loading take seconds)
    fps = video_fps(args, check_before_loading(args.model, pipeline=args.pipeline).spec, sampling)
    resolved = check_before_loading(args.model, sampling, names=FLAG_OF_FIELD, pipeline=args.pipeline)
    if resolved.spec.makes_audio and args.out and os.path.splitext(args.out)[1].lower() not in AUDIO_CODECS:
        raise ConfigError(f"--out {args.out!r}: {args.model} makes videos with a sound track; write one of "
                          f"{', '.join(AUDIO_CODECS)}", field="out")
    if args.image:  # read before the model loads: a bad path fails at once
        prompt["image"] = [open_image(path) for path in args.image]
    progress(f"loading {args.model} (importing torch, reading the weights) ...")
    with Omni(args.model, warmup=not args.no_warmup, **engine_options(args), **lora_opts) as omni:
        t1 = time.perf_counter()
        progress(f"ready in {t1 - t0:.1f} s; generating ...")
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
            audio = None if out.audio is None else out.audio[k]
            write_video(item, target, fps=fps, audio=audio, sample_rate=out.audio_sample_rate)
            desc = f"{len(item)} frames {item[0].width}x{item[0].height}"
            if audio is not None:
                desc += f", sound {audio.shape[-1] / out.audio_sample_rate:.2f} s at {out.audio_sample_rate} Hz"
        else:
            shown = item if args.native_size else upscale_for_display(item)
            shown.save(target)
            desc = f"{item.width}x{item.height}" + ("" if shown is item else f", shown at {shown.width}x{shown.height}")
        written.append(f"{target} ({desc})")
    print(f"wrote {', '.join(written)}")
    print(f"model={args.model} seed={out.metrics.get('seed')} steps={out.metrics.get('steps_run')} "
          f"generate={t2 - t1:.2f}s start-up={t1 - t0:.2f}s")
    return 0

"""``omni lora inspect PATH``, and the LoRA flags of ``omni serve`` / ``omni generate`` (docs/lora.md).

``inspect`` reads the file the way the engine does (diffusers' ``lora_state_dict`` for the model family, with
its converters) and prints its format, rank, alpha and target modules, and with ``--model`` whether it fits
that model (the same checks a request gets, so a file that inspects clean is accepted).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from omni_core.errors import ConfigError

#: the diffusers class whose LoRA loader reads a file when no --model is given
DEFAULT_LOADER = "QwenImagePipeline"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("lora", help="LoRA adapter tools (inspect a file)",
                              description="LoRA adapter tools. See docs/lora.md.")
    sub = p.add_subparsers(dest="lora_command", required=True)
    ins = sub.add_parser("inspect", help="format, rank, alpha, target modules; with --model whether it fits",
                         description="Read a LoRA .safetensors file as the engine does and describe it.")
    ins.add_argument("path", help="a .safetensors adapter file (or a folder holding pytorch_lora_weights.safetensors)")
    ins.add_argument("--model", default=None,
                     help="model name or diffusers folder: read the file with its LoRA loader and check it fits")
    ins.add_argument("--max-lora-rank", type=int, default=64, help="the rank limit to check against (default: 64)")
    ins.add_argument("--json", action="store_true", help="print the report as JSON")
    ins.set_defaults(func=run_inspect)


def run_inspect(args: argparse.Namespace) -> int:
    from omni_core.lora.files import fit_problems, inspect_lora, resolve_lora_path

    if args.model is not None:
        from omni_core.pipelines.loader import resolve_model

        resolved = resolve_model(args.model)
        pipeline_cls, model_path = resolved.pipeline_cls(), resolved.model_path
    else:
        pipeline_cls, model_path = type("Loader", (), {"diffusers_class": DEFAULT_LOADER,
                                                       "__name__": DEFAULT_LOADER}), None
    info = inspect_lora(resolve_lora_path(args.path, {}, "path"), pipeline_cls, "path")
    report: dict[str, Any] = info.describe()
    if args.model is not None:
        problems = fit_problems(info, model_path, tuple(getattr(pipeline_cls, "denoiser_names", ("transformer",))))
        if info.rank > args.max_lora_rank:
            problems.append(f"rank {info.rank} is above max_lora_rank={args.max_lora_rank}")
        report.update(model=args.model, fits=not problems, problems=problems)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for key, value in report.items():
            shown = ", ".join(map(str, value)) if isinstance(value, list) else value
            print(f"{key:>15}: {shown}")
    return 0 if report.get("fits", True) else 1


# ------------------------------------------------------------------------------------------ engine flags
def add_lora_options(group: argparse._ArgumentGroup, *, per_request: bool = False) -> None:
    """``--lora``, ``--max-loras``, ``--max-lora-rank`` (and ``--lora-scale`` for a command that runs one
    request). ``omni serve --lora name=path`` preloads; ``omni generate --lora PATH|name=path`` also uses it."""
    group.add_argument("--lora", action="append", default=None, metavar="NAME=PATH" if not per_request else "LORA",
                       help=("preload a LoRA adapter under a name requests use (repeatable)" if not per_request else
                             "apply a LoRA adapter: a .safetensors path, or NAME=PATH"))
    if per_request:
        group.add_argument("--lora-scale", type=float, default=None, help="the adapter's strength (default: 1.0)")
    group.add_argument("--max-loras", type=int, default=None, help="LoRA adapters kept loaded (LRU; default: 8)")
    group.add_argument("--max-lora-rank", type=int, default=None, help="largest LoRA rank accepted (default: 64)")


def lora_options(args: argparse.Namespace) -> tuple[dict[str, Any], str | None]:
    """(``OmniDiffusionConfig`` keyword arguments, the adapter the one request of ``omni generate`` uses)."""
    opts: dict[str, Any] = {}
    loras, use = {}, None
    for item in args.lora or []:
        name, sep, path = item.partition("=")
        if sep:
            if not name or not path:
                raise ConfigError(f"--lora {item!r} is invalid: expected NAME=PATH", field="lora")
            loras[name] = path
            use = name
        else:
            use = item
    if loras:
        opts["loras"] = loras
    for name in ("max_loras", "max_lora_rank"):
        if getattr(args, name, None) is not None:
            opts[name] = getattr(args, name)
    return opts, use

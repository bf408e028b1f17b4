"""Command-line flags shared by the commands that start an engine (``omni generate``, ``omni serve``)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from omni_core.errors import ConfigError


def add_engine_options(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """Add the "engine options" group; returns it so a command can add its own engine flags to it."""
    eng = parser.add_argument_group("engine options")
    eng.add_argument("--pipeline", default=None,
                     help="the pipeline that runs the model (default: the folder's model_index.json class, else the "
                          "installed pipeline that serves any folder); e.g. diffusers: diffusers' own pipeline")
    eng.add_argument("--attention-backend", default=None,
                     help="default attention backend (one of the names `omni env` lists under attention)")
    eng.add_argument("--cache-backend", default=None, help="cache backend (e.g. cache_dit, tea_cache; default none)")
    eng.add_argument("--cache-config", default=None, help=_cache_config_help().replace("%", "%%"))
    eng.add_argument("--cpu-threads", type=int, default=None,
                     help="torch threads per model process (default: usable CPU cores / model processes)")
    eng.add_argument("--decode-workers", type=int, default=None,
                     help="0 (decode in the model process) or 1: a process of its own runs the VAE decode while the "
                          "denoiser goes on (docs/runtime.md, Stages)")
    eng.add_argument("--decode-device", default=None,
                     help="where the decode process runs: auto (the model's first device), cpu, or a device index")
    eng.add_argument("--encode-workers", type=int, default=None,
                     help="0 (encode in the model process) or 1: a process of its own runs the text encoders, "
                          "encoding each request as it arrives (docs/runtime.md, Stages)")
    eng.add_argument("--encode-device", default=None,
                     help="where the encode process runs: auto (the model's first device), cpu, or a device index")
    eng.add_argument("--dtype", default=None, help="auto, float32, bfloat16 or float16")
    eng.add_argument("--embedding-cache-bytes", type=int, default=None,
                     help="bytes of text-encoder outputs kept for reuse across requests (default 256 MiB; 0: off)")
    eng.add_argument("--executor", default=None, help="uni or mp (default: by the number of processes), or a "
                     "plugin's (e.g. ray)")
    _add_executor_option_flags(eng)
    eng.add_argument("--parallel-config", default=None, help='JSON object, e.g. \'{"ulysses_degree": 2}\'')
    eng.add_argument("--step-execution", action="store_true", help="run requests step by step (step batching)")
    eng.add_argument("--max-preemptions", type=int, default=None,
                     help="step mode: times one request may be preempted by more urgent ones (default 4; 0: "
                          "priority without preemption; docs/scheduling.md)")
    eng.add_argument("--step-time-budget", type=float, default=None, dest="step_time_budget_s",
                     help="seconds one wave's step may take: waves are capped by each shape's cost, learned online "
                          "(default: no cap)")
    # memory and speed options (docs/memory.md)
    eng.add_argument("--quantization", default=None, help="weight-only quantization of the denoiser: int8, fp8 "
                     "(torchao) or none")
    eng.add_argument("--quantize-components", default=None,
                     help="comma-separated components to quantize (default: denoiser; e.g. denoiser,text_encoder)")
    eng.add_argument("--denoiser-weights", default=None, help="a .gguf file with the denoiser's weights")
    eng.add_argument("--offload", default=None, help="model, group or none: keep weights on the host, move them "
                     "to the accelerator just in time")
    eng.add_argument("--vae-tiling", nargs="?", const="true", default=None,
                     help="tiled VAE decode/encode; optionally a JSON object of tile sizes")
    eng.add_argument("--vae-slicing", action="store_true", default=None, help="decode a batch one sample at a time")
    eng.add_argument("--compile", action="store_true", default=None,
                     help="torch.compile the denoiser's repeated blocks (dynamic shapes; compiled in the warm-up)")
    eng.add_argument("--performance-mode", default=None,
                     help="speed, memory or auto: choose the unset options above from model size and free memory")
    eng.add_argument("--preview-decoder", default=None, metavar="FOLDER",
                     help="a folder with a diffusers AutoencoderTiny (TAESD-style) for this model's latents: previews "
                          "decode through it (default: the model's latent-to-RGB projection; docs/previews.md)")
    return eng


def _json_arg(value: str | None, name: str) -> Any:
    if value is None:
        return None
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--{name} must be a JSON object: {exc}", field=name) from None
    if not isinstance(parsed, dict):
        raise ConfigError(f"--{name} must be a JSON object, got {type(parsed).__name__}", field=name)
    return parsed


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """``OmniDiffusionConfig`` keyword arguments from the engine options that were given."""
    opts = {"pipeline": getattr(args, "pipeline", None), "attention_backend": args.attention_backend, "cache_backend": args.cache_backend,
            "cache_config": _json_arg(args.cache_config, "cache-config"), "dtype": args.dtype,
            "executor": args.executor, "cpu_threads": args.cpu_threads,
            **{f"{stage}_{what}": getattr(args, f"{stage}_{what}", None) for stage in ("encode", "decode")
               for what in ("workers", "device")},
            "embedding_cache_bytes": getattr(args, "embedding_cache_bytes", None),
            "parallel_config": _json_arg(args.parallel_config, "parallel-config"),
            "max_preemptions": args.max_preemptions, "step_time_budget_s": args.step_time_budget_s}
    opts.update(_executor_option_values(args))
    tiling = getattr(args, "vae_tiling", None)
    opts.update(quantization=getattr(args, "quantization", None),
                quantize_components=getattr(args, "quantize_components", None),
                denoiser_weights=getattr(args, "denoiser_weights", None), offload=getattr(args, "offload", None),
                vae_tiling=True if tiling == "true" else _json_arg(tiling, "vae-tiling"),
                vae_slicing=getattr(args, "vae_slicing", None), compile=getattr(args, "compile", None),
                performance_mode=getattr(args, "performance_mode", None),
                preview_decoder=getattr(args, "preview_decoder", None))
    opts = {k: v for k, v in opts.items() if v is not None}
    if args.step_execution:
        opts["step_execution"] = True
    return opts


def _cache_config_help() -> str:
    """``--cache-config``'s help: every installed cache backend's keys, from their records (``omni env`` has more)."""
    from omni_core.config import declared_options

    per = [f"{backend}: " + ", ".join(f"{o.name} ({o.kind_text()})" for o in options)
           for backend, options in declared_options("cache").items()]
    return "JSON object of cache backend options" + (f" ({'; '.join(per)}; `omni env` describes them)" if per else "")


def _add_executor_option_flags(eng: argparse._ArgumentGroup) -> None:
    """``--<executor>-<option>`` for every option a registered executor declares (``ExecutorSpec.options``), typed
    by the option record."""
    from omni_core.config import declared_options

    for executor, options in declared_options("executor").items():
        for option in options:
            eng.add_argument(f"--{executor}-{option.name}".replace("_", "-"), dest=f"executor_option:{executor}_"
                             f"{option.name}", default=None, **option.cli_kwargs(),
                             help=f"(executor {executor}) {option.describe()}".replace("%", "%%"))


def _executor_option_values(args: argparse.Namespace) -> dict[str, Any]:
    """``{"<executor>_<option>": value}`` of the executor option flags that were given."""
    return {key.split(":", 1)[1]: value for key, value in vars(args).items()
            if key.startswith("executor_option:") and value is not None}

"""Memory and speed options of the engine: quantization, GGUF weights, offload, VAE tiling/slicing, compile,
performance presets. One module per concept; this one checks them before start-up and applies them, in a fixed
order, to a loaded pipeline of any model (the loader calls it; no model names an option).

Imports nothing heavy: torch, torchao, gguf and diffusers are imported when an option is used.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("omni_core.optimize")

#: the config fields this package reads (all default to None: "unset", so a preset may fill them)
FIELDS = ("quantization", "quantize_components", "denoiser_weights", "offload", "vae_tiling", "vae_slicing",
          "compile", "performance_mode")
#: the attribute of a loaded pipeline holding what was applied (the start-up log, ``omni env``)
APPLIED_ATTR = "omni_optimizations"


def check_config(config: Any, platform: Any) -> None:
    """Refuse, before any worker starts, options that cannot run here (library missing, device lacking a
    kernel, offload with several ranks per device): a ConfigError naming the field and the reason."""
    from omni_core.optimize.offload import check_offload
    from omni_core.optimize.quantize import check_quantization

    check_quantization(config, platform.device_type)
    check_offload(config, platform)


def resolve_preset(config: Any, model_path: str, platform: Any) -> tuple[Any, dict[str, Any]]:
    """``config`` with ``performance_mode``'s choices filled in, and the report (see :mod:`.presets`)."""
    from omni_core.optimize.presets import apply_preset

    return apply_preset(config, model_path, platform.get_torch_device(0))


def load_kwargs(pipeline_cls: Any, model_path: str, config: Any, dtype: Any) -> dict[str, Any]:
    """Extra ``model_kwargs`` for the pipeline's ``load``: a GGUF-loaded denoiser when ``denoiser_weights``."""
    if getattr(config, "denoiser_weights", None) is None:
        return {}
    from omni_core.optimize.quantize import gguf_denoiser_kwargs

    return gguf_denoiser_kwargs(pipeline_cls, model_path, config.denoiser_weights, dtype)


def apply_optimizations(pipeline: Any, config: Any, device: Any) -> dict[str, Any]:
    """Apply the config's options to a loaded pipeline -- quantize, VAE options, compile, then offload (hooks
    go on last, around the final modules) -- and return what was done (also kept on the pipeline)."""
    applied: dict[str, Any] = {}
    if getattr(config, "denoiser_weights", None):
        applied["denoiser_weights"] = config.denoiser_weights
    method = getattr(config, "quantization", None)
    if method not in (None, "none"):
        from omni_core.optimize.quantize import quantize_pipeline

        applied["quantization"] = {"method": method,
                                   "components": quantize_pipeline(pipeline, method, config.quantize_components)}
    from omni_core.optimize.vae import apply_vae_options

    applied.update(apply_vae_options(pipeline, getattr(config, "vae_tiling", None),
                                     getattr(config, "vae_slicing", None)))
    if getattr(config, "compile", None):
        from omni_core.optimize.compile import compile_denoisers

        applied.update(compile_denoisers(pipeline))
    mode = getattr(config, "offload", None)
    if mode not in (None, "none"):
        from omni_core.optimize.offload import apply_offload

        applied.update(apply_offload(pipeline, mode, device))
    setattr(pipeline, APPLIED_ATTR, applied)
    if applied:
        logger.info("memory/speed options applied: %s", applied)
    return applied


__all__ = ["APPLIED_ATTR", "FIELDS", "apply_optimizations", "check_config", "load_kwargs", "resolve_preset"]

"""Memory and speed options of the engine: quantization, GGUF weights, offload, VAE tiling/slicing, compile,
performance presets. One module per concept; this one checks them before start-up; :mod:`.plan` decides the order
in which they apply while a pipeline of any model loads (the loader runs the plan; no model names an option).

Imports nothing heavy: torch, torchao, gguf and diffusers are imported when an option is used.
"""

from __future__ import annotations

from typing import Any

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


__all__ = ["APPLIED_ATTR", "FIELDS", "check_config", "load_kwargs", "resolve_preset"]

"""``performance_mode``: pick memory and speed options from the model's size and the device's free memory.

A preset only fills options the user left unset (``None``); an option the user set -- ``quantization="none"``,
``compile=False`` included -- is kept and reported as kept. The choice is a pure function of the config, the
folder's weight bytes and the free memory, so ``omni env --model M`` prints exactly what start-up will do.

* ``speed``: ``compile=True`` (regional; worth it on accelerators, ~1.2x measured on CPU for a large model).
* ``memory``: int8 weight-only denoiser (if usable here), VAE tiling and slicing (if the model has a VAE), and on
  an accelerator model offload (on CPU offload saves nothing: weights stay in the same memory).
* ``auto``: ``speed`` on an accelerator when the weights fit with headroom, nothing on CPU when they fit (a
  compile costs tens of seconds of start-up there), ``memory`` when they do not fit, plus group offload when
  even int8 would not fit.
"""

from __future__ import annotations

import logging
import os
from typing import Any

logger = logging.getLogger("omni_core.optimize")

MODES = ("speed", "memory", "auto")
#: weights must fit in this fraction of free memory (activations, the VAE decode and the allocator need the rest)
HEADROOM = 0.7
#: int8 weight-only keeps about this fraction of float32 denoiser bytes (0.28x measured on tiny Qwen-Image)
INT8_FRACTION = 0.35


def folder_weight_bytes(model_path: str, extra: str | None = None) -> int:
    """Bytes of the weight files (``.safetensors``, ``.gguf``) under a model folder, plus ``extra``'s."""
    total = 0
    for root, _, files in os.walk(model_path):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files if f.endswith((".safetensors", ".gguf")))
    if extra and os.path.isfile(extra):
        total += os.path.getsize(extra)
    return total


def free_memory_bytes(device: Any) -> int:
    """Free memory of ``device``: ``MemAvailable`` for CPU, ``mem_get_info`` for an accelerator (0 if unknown),
    asked in a child process unless this one has initialised the device already (:mod:`.device_probe`)."""
    kind = getattr(device, "type", str(device))
    if kind == "cpu":
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return 0
        return 0
    from omni_core.optimize.device_probe import free_memory_bytes as device_free_bytes

    index = getattr(device, "index", None)
    return device_free_bytes(kind, 0 if index is None else index)  # no device context in this process


def choose(config: Any, model_path: str, device: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(changes, report)``: the option values the preset sets (only unset ones) and what it saw and decided."""
    from omni_core.optimize.quantize import method_status

    mode = config.performance_mode
    kind = getattr(device, "type", str(device))
    weights = folder_weight_bytes(model_path, config.denoiser_weights)
    if mode is None:  # nothing to choose: the device is not asked (on a GPU that would cost a probe)
        return {}, {"performance_mode": None, "device": kind, "weight_bytes": weights}
    free = free_memory_bytes(device)
    fits = free == 0 or weights <= HEADROOM * free
    report: dict[str, Any] = {"performance_mode": mode, "device": kind, "weight_bytes": weights, "free_bytes": free,
                              "fits": fits}
    has_vae = os.path.isdir(os.path.join(model_path, "vae"))
    wanted: dict[str, Any] = {}
    if mode == "speed" or (mode == "auto" and fits and kind != "cpu"):
        wanted["compile"] = True
        report["reason"] = "speed" if mode == "speed" else "the weights fit with headroom on an accelerator"
    elif mode == "auto" and fits:
        report["reason"] = "the weights fit; on CPU compile would cost start-up time for little gain"
    else:
        if config.denoiser_weights is None and method_status("int8", kind)[0]:
            wanted["quantization"] = "int8"
        if has_vae:
            wanted.update(vae_tiling=True, vae_slicing=True)
        if kind != "cpu" and config.world_size == 1:
            small = weights * INT8_FRACTION <= HEADROOM * free
            wanted["offload"] = "model" if mode == "memory" or small else "group"
        report["reason"] = "memory" if mode == "memory" else "the weights do not fit in free memory"
    changes = {k: v for k, v in wanted.items() if getattr(config, k) is None}
    report["chose"] = changes
    report["kept"] = {k: getattr(config, k) for k in wanted if k not in changes}
    return changes, report


def apply_preset(config: Any, model_path: str, device: Any) -> tuple[Any, dict[str, Any]]:
    """The config with the preset's choices filled in (unchanged without ``performance_mode``), and the report."""
    import attrs

    changes, report = choose(config, model_path, device)
    if config.performance_mode is not None:
        logger.info("performance_mode=%s: %s; chose %s%s", config.performance_mode, report.get("reason"),
                    changes or "nothing", f", kept the user's {report['kept']}" if report.get("kept") else "")
    return (attrs.evolve(config, **changes) if changes else config), report

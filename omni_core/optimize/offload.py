"""Offload: keep weights in host memory and move them to the accelerator just in time.

* ``"model"``: whole components, one at a time (text encoder -> denoiser -> VAE -> text encoder ...), each
  brought in before it runs and evicting the one before it, in a ring (a serving loop has no "end of call"):
  :mod:`.model_offload` (our registry's hook, not accelerate's, so a LoRA loaded at run time keeps it).
* ``"group"``: diffusers' ``apply_group_offloading`` per component, one block per group, prefetching the next
  group on a side stream where the device has streams (CUDA-like); elsewhere synchronous.

On CPU the onload and offload devices are the same, so the hooks run (and are tested for parity) but save
nothing; several ranks sharing one device would each hold the host copy and fight over the device, so that
is refused before any worker starts.
"""

from __future__ import annotations

import logging
from typing import Any

from omni_core.errors import ConfigError

logger = logging.getLogger("omni_core.optimize")

MODES = ("model", "group")


def check_offload(config: Any, platform: Any) -> None:
    """Refuse offload that cannot work with the executor: several ranks on fewer devices."""
    if config.offload in (None, "none"):
        return
    if config.world_size > 1 and platform.device_count() < config.world_size:
        raise ConfigError(f"offload={config.offload!r} with parallel_config {config.parallel_config.describe_world()}"
                          f" on {platform.device_count()} {platform.name} device(s) is refused: ranks sharing a "
                          f"device would each keep a host copy and swap weights in turn; use one rank per device, "
                          f"or offload=None", field="offload")


def has_streams(device: Any) -> bool:
    """Whether ``device``'s backend implements streams (diffusers' ``use_stream`` needs them)."""
    import torch

    mod = getattr(torch, getattr(device, "type", str(device)), None)
    return device.type != "cpu" and mod is not None and hasattr(mod, "Stream") and getattr(
        mod, "is_available", lambda: False)()


def apply_offload(pipeline: Any, mode: str, device: Any) -> dict[str, Any]:
    """Install ``mode`` offload on every component; returns what was done (for the start-up log)."""
    import torch

    from omni_core.optimize.components import components_of

    components = components_of(pipeline)
    cpu = torch.device("cpu")
    device = torch.device(device)
    if mode == "model":
        from omni_core.hooks import add_hook
        from omni_core.optimize.model_offload import MODEL_OFFLOAD_HOOK, ModelOffload, OffloadRing

        ring = OffloadRing(device)
        for module in components.values():
            add_hook(module, MODEL_OFFLOAD_HOOK, ModelOffload(ring))
        return {"offload": "model", "components": list(components)}
    if mode == "group":
        from diffusers.hooks import apply_group_offloading

        stream = has_streams(device)
        for module in components.values():
            module.to(cpu)
            apply_group_offloading(module, onload_device=device, offload_device=cpu, offload_type="block_level",
                                   num_blocks_per_group=1, use_stream=stream)
        return {"offload": "group", "components": list(components), "use_stream": stream}
    raise ConfigError(f"offload={mode!r} is not one of {', '.join(MODES)}", field="offload")

"""Omni's attention backend names on diffusers' attention dispatcher (the diffusers backend's denoisers).

An Omni backend's record names the same kernel in diffusers' dispatcher (``AttentionBackendSpec.diffusers_backend``),
so a config's ``attention_backend`` reaches a pipeline run through its own call, and diffusers' own availability
check decides whether it can run here.
"""

from __future__ import annotations

from typing import Any

from omni_core.errors import ConfigError
from omni_core.utils.denoisers import DIFFUSERS_DENOISERS

def dispatcher_backend(config: Any) -> tuple[str, str] | None:
    """``(Omni's backend name, diffusers' dispatcher name)`` the config asks for, from the backend's record
    (``AttentionBackendSpec.diffusers_backend``), or None (diffusers' default). Diffusers' dispatcher sets one backend
    per model, so per-role choices are refused."""
    from omni_core.plugins.manager import get_plugin_manager

    attention = getattr(config, "attention_config", None)
    if attention is None:
        return None
    if attention.per_role:
        raise ConfigError("attention_config.per_role: the diffusers backend sets one attention backend per denoiser "
                          "(diffusers' dispatcher has no roles); give attention_backend alone", field="attention_config")
    spec, _ = attention.resolve("diffusers")
    if spec is None:
        return None
    pm = get_plugin_manager()
    record = pm.get_component("attention", spec.backend)
    if record.diffusers_backend is None:
        usable = sorted(n for n, r in pm.components("attention").items() if r.diffusers_backend)
        raise ConfigError(f"attention backend {spec.backend!r} ({record.provider}) names no diffusers dispatcher "
                          f"backend (AttentionBackendSpec.diffusers_backend); the diffusers backend can use "
                          f"{', '.join(usable) or 'none'}", field="attention_backend")
    return spec.backend, record.diffusers_backend


def set_dispatcher_backend(pipe: Any, omni_name: str, name: str) -> None:
    """Every denoiser of ``pipe`` on diffusers' dispatcher backend ``name`` (its own availability check runs)."""
    for component in DIFFUSERS_DENOISERS:
        module = getattr(pipe, component, None)
        if module is None or not hasattr(module, "set_attention_backend"):
            continue
        try:
            module.set_attention_backend(name)
        except Exception as exc:  # noqa: BLE001 - diffusers says why (a missing kernel library, a device)
            raise ConfigError(f"attention backend {omni_name!r} (diffusers' {name!r}) cannot run {component} here: "
                              f"{type(exc).__name__}: {exc}", field="attention_backend") from exc


__all__ = ["dispatcher_backend", "set_dispatcher_backend"]

"""Resolution of the current platform: ``OMNI_PLATFORM``, else one detected plugin platform, else CPU."""

from __future__ import annotations

import os
import threading
from typing import Any

import attrs

from omni_core.errors import ComponentUnavailableError, ConfigError, PlatformResolutionError
from omni_core.platforms.interface import Platform

FALLBACK = "cpu"


@attrs.define
class PlatformResolution:
    platform: Platform
    name: str
    reason: str
    trace: list[str] = attrs.field(factory=list)


def _detect(spec) -> tuple[bool, str]:
    from omni_core.plugins.types import resolve_impl

    result = resolve_impl(spec.detect)()
    if isinstance(result, tuple):
        return bool(result[0]), str(result[1]) if len(result) > 1 else ""
    return bool(result), ""


def resolve_platform(pm=None, requested: str | None = None) -> PlatformResolution:
    """Resolve which platform runs here and record why (``omni env`` prints the trace)."""
    from omni_core.plugins.manager import get_plugin_manager

    pm = pm or get_plugin_manager()
    trace: list[str] = []
    requested = requested or os.environ.get("OMNI_PLATFORM", "").strip() or None
    if requested:
        spec = pm.get_component("platform", requested)
        platform = spec.load()()
        ok, why = platform.is_available()
        trace.append(f"OMNI_PLATFORM/config requests {requested!r} ({spec.provider})")
        if not ok:
            raise ComponentUnavailableError(f"platform {requested!r} was requested but cannot run here: {why}")
        return PlatformResolution(platform, requested, "requested explicitly", trace)

    detected = []
    for name, spec in sorted(pm.components("platform").items()):
        if spec.detect is None:
            trace.append(f"{name} ({spec.provider}): built-in fallback, not auto-detected")
            continue
        try:
            ok, why = _detect(spec)
        except Exception as exc:  # noqa: BLE001 - a broken detector must not break resolution
            ok, why = False, f"detector raised {type(exc).__name__}: {exc}"
        trace.append(f"{name} ({spec.provider}): {'detected' if ok else 'not detected'}{': ' + why if why else ''}")
        if ok:
            detected.append((name, spec))
    if len(detected) > 1:
        names = ", ".join(f"{n} ({s.provider})" for n, s in detected)
        raise PlatformResolutionError(f"several platforms detected: {names}; set OMNI_PLATFORM to choose one")
    if detected:
        name, spec = detected[0]
        return PlatformResolution(spec.load()(), name, "the only detected platform", trace)
    spec = pm.get_component("platform", FALLBACK)
    return PlatformResolution(spec.load()(), FALLBACK, "no accelerator platform detected; CPU fallback", trace)


_current: PlatformResolution | None = None
_requested: dict[str, Platform] = {}
_lock = threading.Lock()


def platform_for(config: Any = None) -> Platform:
    """The platform a config runs on: its ``platform`` field when set (the platform must be usable here,
    else :class:`ComponentUnavailableError` with its reason), else ``current_platform``. The engine, the
    executors and every worker call this, so all of them agree."""
    name = getattr(config, "platform", None)
    if name is None:
        return current_resolution().platform
    with _lock:
        if name not in _requested:
            _requested[name] = resolve_platform(requested=name).platform
        return _requested[name]


def check_world_size(config: Any, platform: Platform) -> None:
    """Refuse (before any worker starts) a world size the platform cannot place, unless ``oversubscribe``."""
    world = config.parallel_config.world_size
    capacity, what = platform.max_world_size()
    if world <= max(capacity, 1) or getattr(config, "oversubscribe", False):
        return
    raise ConfigError(
        f"parallel_config needs {config.parallel_config.describe_world()} but platform {platform.name!r} can place "
        f"{capacity} ({what}); lower the degrees to a product of at most {capacity}, or pass oversubscribe=True "
        f"(omni serve --oversubscribe) to start {world} processes anyway", field="parallel_config")


def current_resolution() -> PlatformResolution:
    global _current
    if _current is None:
        with _lock:
            if _current is None:
                _current = resolve_platform()
    return _current


def reset_current_platform() -> None:
    global _current
    _current = None
    _requested.clear()

"""Can this component run here? One walk for every caller (``omni env``, the attention selector, the runner's
cache loading, the GPU platforms' choice of a default kernel).

The walk, in order: the record's ``requires`` (found without importing them) -> import the class (checked
against its record) -> a subclass of the kind's base class -> ``is_available()`` -> what the context names:
head size, dtype and device type, compute capability. It stops at the first step that fails and says why;
callers word their errors around ``reason`` and the failing ``step``.
"""

from __future__ import annotations

from typing import Any

import attrs

from omni_core.plugins.types import ComponentSpec, kind_of, missing_requirements

#: the steps of the walk, in order (``Availability.step`` names the one that failed)
STEPS = ("requires", "import", "record", "base", "is_available", "head_size", "call", "device", "capability")


@attrs.frozen
class Context:
    """What the caller knows about where the component would run (None: not checked)."""

    #: torch device type (``"cpu"``, ``"cuda"``)
    device_type: str | None = None
    #: dtype name or torch dtype; checked together with ``device_type`` through the class's ``check_call``
    dtype: Any = None
    head_size: int | None = None
    causal: bool = False
    #: GPU compute capability ``(major, minor)`` (asked through the class's ``check_capability``)
    capability: tuple[int, int] | None = None


@attrs.frozen
class Availability:
    """The answer of :func:`check_record`: ``ok``, else ``reason`` and the failing ``step``."""

    ok: bool
    reason: str = ""
    #: the implementation, once imported (None if the walk stopped before the import)
    cls: Any = None
    step: str | None = None
    #: the exception behind an ``import``/``record``/``is_available`` failure
    error: BaseException | None = None

    def __bool__(self) -> bool:
        return self.ok


def check_record(record: ComponentSpec, ctx: Context | None = None, *, until: str | None = None) -> Availability:
    """Walk ``record`` through every check the context allows (or up to step ``until``, e.g. ``"base"`` to
    only import it); the first failure is the answer."""
    ctx = ctx or Context()
    missing = missing_requirements(record.requires)
    if missing:
        return Availability(False, f"needs the Python package(s) {', '.join(missing)}, which are not installed",
                            step="requires")
    try:
        cls = record.load()
    except Exception as exc:  # noqa: BLE001 - the reason is the answer
        from omni_core.errors import RecordMismatchError

        step = "record" if isinstance(exc, RecordMismatchError) else "import"
        reason = str(exc) if step == "record" else f"cannot import {record.impl}: {type(exc).__name__}: {exc}"
        return Availability(False, reason, step=step, error=exc)
    kind = kind_of(record)
    base = kind.base()
    if not (isinstance(cls, type) and issubclass(cls, base)):
        return Availability(False, f"{record.impl} is not a {base.__name__} subclass", cls, step="base")
    if until in ("requires", "import", "record", "base"):
        return Availability(True, "", cls)

    def fail(step: str, reason: str, error: BaseException | None = None) -> Availability:
        return Availability(False, reason, cls, step=step, error=error)

    try:
        probe = getattr(cls() if kind.probe_instance else cls, "is_available", None)
        ok, why = probe() if probe is not None else (True, "")  # pipelines, schedulers, executors: no probe
    except Exception as exc:  # noqa: BLE001
        return fail("is_available", f"is_available() raised {type(exc).__name__}: {exc}", exc)
    if not ok:
        return fail("is_available", why)
    if ctx.head_size is not None and hasattr(cls, "check_head_size"):
        why = cls.check_head_size(ctx.head_size)
        if why:
            return fail("head_size", why)
    if ctx.dtype is not None and ctx.device_type is not None and hasattr(cls, "check_call"):
        why = cls.check_call(ctx.dtype, str(ctx.device_type), False, ctx.causal)
        if why:
            return fail("call", why)
    elif ctx.device_type is not None:
        devices = getattr(cls, "supported_devices", None)
        if devices is not None and ctx.device_type not in devices:
            return fail("device", f"does not run on device type {ctx.device_type!r} (supports {', '.join(devices)})")
    if ctx.capability is not None and hasattr(cls, "check_capability"):
        why = cls.check_capability(ctx.capability)
        if why:
            return fail("capability", why)
    return Availability(True, "", cls)


def check_component(kind: str, name: str, ctx: Context | None = None, pm: Any = None, *,
                    until: str | None = None) -> Availability:
    """:func:`check_record` for the component ``name`` of ``kind``; an unknown or conflicting name raises
    (:class:`~omni_core.errors.UnknownComponentError` / :class:`~omni_core.errors.ComponentConflictError`)."""
    if pm is None:
        from omni_core.plugins.manager import get_plugin_manager

        pm = get_plugin_manager()
    return check_record(pm.get_component(kind, name), ctx, until=until)


__all__ = ["STEPS", "Availability", "Context", "check_component", "check_record"]

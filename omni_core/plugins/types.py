"""Registration records returned by the ``omni_register_*`` hooks.

A record is cheap metadata plus a ``"module:attr"`` string naming the implementation; the manager fills
in ``provider`` (the distribution that returned it) so conflicts and failures can name a package.
"""

from __future__ import annotations

import importlib.util
import os
import pkgutil
import re
from typing import Any, ClassVar

import attrs

from omni_core.sampling_fields import SamplingField, check_declarations

_IMPL_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def _check_impl(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is None and attribute.name != "impl":
        return
    if not isinstance(value, str) or not _IMPL_RE.match(value):
        raise ValueError(
            f"{type(instance).__name__}.{attribute.name} must be a 'module:attr' string, got {value!r}"
        )


def _check_model_path(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    """``default_model_path`` is a ``"module:attr"`` function reference or an absolute folder path."""
    if value is None or (isinstance(value, str) and (_IMPL_RE.match(value) or os.path.isabs(value))):
        return
    raise ValueError(f"{type(instance).__name__}.default_model_path must be a 'module:attr' string naming a "
                     f"function that returns the model folder, or an absolute folder path; got {value!r}")


def is_impl_ref(value: str) -> bool:
    """Whether ``value`` is a ``"module:attr"`` reference (as opposed to a plain path)."""
    return bool(_IMPL_RE.match(value))


def _check_name(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{type(instance).__name__}.name must be a non-empty string, got {value!r}")


def resolve_impl(qualname: str) -> Any:
    """Import and return the object named by ``"module:attr"``."""
    return pkgutil.resolve_name(qualname)


def missing_requirements(requires: tuple[str, ...]) -> list[str]:
    """Import names in ``requires`` that cannot be found (checked without importing them)."""
    missing = []
    for mod in requires:
        try:
            if importlib.util.find_spec(mod) is None:
                missing.append(mod)
        except (ImportError, ValueError):
            missing.append(mod)
    return missing


@attrs.frozen(kw_only=True)
class ComponentSpec:
    """Fields every record shares."""

    kind: ClassVar[str] = "component"

    name: str = attrs.field(validator=_check_name)
    impl: str = attrs.field(validator=_check_impl)
    description: str = ""
    #: import names that must be importable for the component to be usable (not imported to check)
    requires: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    #: filled by the plugin manager: the distribution (or built-in plugin) that registered the record
    provider: str = ""

    def load(self) -> Any:
        """Import the implementation."""
        return resolve_impl(self.impl)


@attrs.frozen(kw_only=True)
class PlatformSpec(ComponentSpec):
    kind: ClassVar[str] = "platform"
    #: ``"module:attr"`` of a cheap, side-effect free function returning ``(available, reason)``;
    #: ``None`` for the built-in CPU fallback, which is never auto-detected.
    detect: str | None = attrs.field(default=None, validator=_check_impl)


@attrs.frozen(kw_only=True)
class AttentionBackendSpec(ComponentSpec):
    kind: ClassVar[str] = "attention"


@attrs.frozen(kw_only=True)
class CacheBackendSpec(ComponentSpec):
    kind: ClassVar[str] = "cache"


@attrs.frozen(kw_only=True)
class PipelineSpec(ComponentSpec):
    kind: ClassVar[str] = "pipeline"
    #: short model names accepted as ``model=`` (e.g. ``"shapes"``)
    model_names: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    #: the folder of the model named by ``model_names``: either ``"module:attr"`` of a function (no arguments)
    #: returning it, resolved only when the name is used (so the entry-point module stays cheap), or an
    #: absolute folder path as a plain string
    default_model_path: str | None = attrs.field(default=None, validator=_check_model_path)
    #: parallel strategies the pipeline supports: any of ulysses, ring, cfg, data
    supported_parallel: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    #: the model's own sampling knobs (beyond ``SamplingParams``' core fields); the same constant as the
    #: pipeline class's ``sampling_fields``, read here so the core needs no pipeline import to validate them
    sampling_fields: tuple[SamplingField, ...] = attrs.field(default=(), converter=tuple,
                                                             validator=check_declarations)


@attrs.frozen(kw_only=True)
class SchedulerSpec(ComponentSpec):
    kind: ClassVar[str] = "scheduler"


@attrs.frozen(kw_only=True)
class ExecutorSpec(ComponentSpec):
    kind: ClassVar[str] = "executor"


#: kind name -> (record class, registration hook name)
KINDS: dict[str, tuple[type[ComponentSpec], str]] = {
    "platform": (PlatformSpec, "omni_register_platforms"),
    "attention": (AttentionBackendSpec, "omni_register_attention_backends"),
    "cache": (CacheBackendSpec, "omni_register_cache_backends"),
    "pipeline": (PipelineSpec, "omni_register_pipelines"),
    "scheduler": (SchedulerSpec, "omni_register_schedulers"),
    "executor": (ExecutorSpec, "omni_register_executors"),
}

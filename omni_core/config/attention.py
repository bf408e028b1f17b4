"""Which attention backend each layer role uses (``attention_config``)."""

from __future__ import annotations

import os
from typing import Any, Mapping

import attrs

from omni_core.config.validators import _FromKwargs, _dict_or_empty, _fail, coerce_record, dict_field
from omni_core.errors import ConfigError


def _backend_name(instance, attribute, value):
    if not isinstance(value, str) or not value.strip():
        _fail(instance, attribute, value, "expected the name of an installed attention backend (omni env lists them)")


@attrs.frozen
class AttentionSpec(_FromKwargs):
    """One backend choice: its name plus backend-specific options passed to the implementation."""

    backend: str = attrs.field(validator=_backend_name)
    options: dict = attrs.field(factory=dict, converter=_dict_or_empty, validator=dict_field)

    @classmethod
    def coerce(cls, value: Any) -> AttentionSpec:
        return coerce_record(cls, value, shorthand="backend", none_is_default=False, field="attention_config",
                             error="attention spec must be a backend name, a dict or AttentionSpec, got {value!r}")


def _coerce_spec_or_none(value: Any) -> AttentionSpec | None:
    return None if value is None else AttentionSpec.coerce(value)


def _coerce_per_role(value: Any) -> dict[str, AttentionSpec]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"AttentionConfig.per_role must map role -> backend, got {value!r}", field="per_role")
    return {str(role): AttentionSpec.coerce(spec) for role, spec in value.items()}


@attrs.frozen
class AttentionConfig(_FromKwargs):
    """Which attention backend each role uses: a global default plus a per-role map.

    Resolution order for a layer with ``role`` and ``role_category``: ``per_role[role]`` ->
    ``per_role[role_category]`` -> ``default`` -> ``OMNI_ATTENTION_BACKEND`` -> the platform's default.
    """

    default: AttentionSpec | None = attrs.field(default=None, converter=_coerce_spec_or_none)
    per_role: dict[str, AttentionSpec] = attrs.field(factory=dict, converter=_coerce_per_role)

    @classmethod
    def coerce(cls, value: Any) -> AttentionConfig:
        return coerce_record(cls, value, shorthand="default", field="attention_config",
                             error="attention_config must be a dict, a backend name or AttentionConfig, got {value!r}")

    def resolve(self, role: str, role_category: str | None = None) -> tuple[AttentionSpec | None, str]:
        """The configured spec for a layer and where it came from (``None`` means: fall through)."""
        if role in self.per_role:
            return self.per_role[role], f"per_role[{role!r}]"
        if role_category is not None and role_category in self.per_role:
            return self.per_role[role_category], f"per_role[{role_category!r}] (role category)"
        if self.default is not None:
            return self.default, "attention_config.default"
        env = os.environ.get("OMNI_ATTENTION_BACKEND", "").strip()
        if env:
            return AttentionSpec(backend=env), "OMNI_ATTENTION_BACKEND"
        return None, "platform default"

    def backend_names(self) -> set[str]:
        names = {s.backend for s in self.per_role.values()}
        if self.default is not None:
            names.add(self.default.backend)
        return names

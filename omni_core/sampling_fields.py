"""Sampling fields a model declares (e.g. a second guidance scale, a strength).

The core's :class:`~omni_core.config.SamplingParams` holds the knobs every model shares; a knob only one model
understands is declared by that model as a :class:`SamplingField` on its ``PipelineSpec`` record (and the
same constant on its pipeline class). The record is cheap metadata, so the core validates such a field, gives
it a CLI flag and an HTTP body field, and keys batches on it without importing the pipeline (which imports
torch and diffusers). Imports nothing heavy, and nothing of ``omni_core`` but the errors.
"""

from __future__ import annotations

import keyword
import numbers
from typing import Any

import attrs

#: the value types a field may declare
FIELD_TYPES = ("float", "int", "bool", "str", "choice")


def _check_name(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, str) or not value.isidentifier() or keyword.iskeyword(value) or value.startswith("_"):
        raise ValueError(f"SamplingField.name must be a Python identifier not starting with '_' (it becomes a "
                         f"keyword argument, an attribute and a request field), got {value!r}")


def _check_type(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value not in FIELD_TYPES:
        raise ValueError(f"SamplingField {instance.name!r}: type={value!r} is invalid; allowed: "
                         f"{', '.join(FIELD_TYPES)}")


def _check_bound(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
        raise ValueError(f"SamplingField {instance.name!r}: {attribute.name}={value!r} must be a number or None")


@attrs.frozen(kw_only=True)
class SamplingField:
    """One model-declared sampling knob. ``default`` is what the model uses when a request leaves it unset
    (``None``: the model decides at run time); ``min``/``max`` bound ``float``/``int`` values; ``choices`` are
    the values of a ``choice`` field; ``splits_batch``: requests with different values never share a wave
    (the model computes a batch with one value); ``help`` is shown by ``omni generate --help`` and OpenAPI."""

    name: str = attrs.field(validator=_check_name)
    type: str = attrs.field(validator=_check_type)
    default: Any = None
    min: float | None = attrs.field(default=None, validator=_check_bound)
    max: float | None = attrs.field(default=None, validator=_check_bound)
    choices: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    splits_batch: bool = False
    help: str = ""

    def __attrs_post_init__(self) -> None:
        if (self.type == "choice") != bool(self.choices):
            raise ValueError(f"SamplingField {self.name!r}: choices are required for type 'choice' and only "
                             f"allowed for it (type={self.type!r}, choices={self.choices!r})")
        if self.type not in ("float", "int") and (self.min is not None or self.max is not None):
            raise ValueError(f"SamplingField {self.name!r}: min/max apply to 'float' and 'int' fields only")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"SamplingField {self.name!r}: min={self.min} is larger than max={self.max}")
        if not isinstance(self.splits_batch, bool):
            raise ValueError(f"SamplingField {self.name!r}: splits_batch must be True or False")

    @property
    def flag(self) -> str:
        """The ``omni generate`` option: ``shift_scale`` -> ``--shift-scale``."""
        return "--" + self.name.replace("_", "-")


def check_declarations(instance: Any, attribute: attrs.Attribute, value: tuple) -> None:
    """attrs validator of a record's ``sampling_fields``: SamplingField items with distinct names."""
    names = []
    for item in value:
        if not isinstance(item, SamplingField):
            raise ValueError(f"{type(instance).__name__}.{attribute.name} must hold SamplingField records, got "
                             f"{type(item).__name__} {item!r}")
        if item.name in names:
            raise ValueError(f"{type(instance).__name__}.{attribute.name} declares {item.name!r} twice")
        names.append(item.name)

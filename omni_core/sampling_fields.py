"""Sampling fields a model declares (e.g. a second guidance scale, a strength).

The core's :class:`~omni_core.config.SamplingParams` holds the knobs every model shares; a knob only one model
understands is declared by that model as a :class:`SamplingField` on its ``PipelineSpec`` record (and the
same constant on its pipeline class). A ``SamplingField`` is the model-knob use of the one option record,
:class:`~omni_core.options.Option` (executors and cache backends declare theirs with it too), plus
``splits_batch``. The record is cheap metadata, so the core validates such a field, gives it a CLI flag and an
HTTP body field, and keys batches on it without importing the pipeline (which imports torch and diffusers).
Imports nothing heavy, and nothing of ``omni_core`` but the errors and the option record.
"""

from __future__ import annotations

from typing import ClassVar

import attrs

from omni_core.options import Option, option_tuple

#: the value types a sampling field may declare (a request field: no lists)
FIELD_TYPES = ("float", "int", "bool", "str", "choice")


@attrs.frozen(kw_only=True)
class SamplingField(Option):
    """One model-declared sampling knob. ``default`` is what the model uses when a request leaves it unset
    (``None``: the model decides at run time); ``min``/``max`` bound ``float``/``int`` values; ``choices`` are
    the values of a ``choice`` field; ``splits_batch``: requests with different values never share a wave
    (the model computes a batch with one value); ``help`` is shown by ``omni generate --help`` and OpenAPI."""

    TYPES: ClassVar[tuple[str, ...]] = FIELD_TYPES

    splits_batch: bool = False

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        if not isinstance(self.splits_batch, bool):
            raise ValueError(f"SamplingField {self.name!r}: splits_batch must be True or False")


#: attrs validator of a record's ``sampling_fields``: SamplingField items with distinct names
check_declarations = option_tuple(SamplingField)

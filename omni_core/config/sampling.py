"""``SamplingParams``: prompt-independent generation knobs, plus the sampling fields models declare."""

from __future__ import annotations

from typing import Any

import attrs

from omni_core.config.bounds import (GUIDANCE_MAX, LORA_SCALE_MAX, MAX_FRAMES, MAX_INFERENCE_STEPS,
                                     MAX_OUTPUTS_PER_PROMPT, MAX_SIDE, OUTPUT_TYPES)
from omni_core.config.rollout import RolloutOptions, coerce_rollout
from omni_core.config.validators import (_dict_or_empty, _fail, _FromKwargs, choice_field, dict_field,
                                         float_field, int_field, str_field)
from omni_core.errors import ConfigError
from omni_core.sampling_fields import SamplingField


def registered_sampling_fields() -> dict[str, list[tuple[str, SamplingField]]]:
    """``{field name: [(pipeline, declaration), ...]}`` of every registered pipeline's ``sampling_fields``, read
    from the plugin manager's records (no pipeline is imported)."""
    from omni_core.plugins.manager import get_plugin_manager

    out: dict[str, list[tuple[str, SamplingField]]] = {}
    for name, spec in sorted(get_plugin_manager().components("pipeline").items()):
        for field in getattr(spec, "sampling_fields", ()):
            out.setdefault(field.name, []).append((name, field))
    return out


def check_sampling_field(instance: Any, field: SamplingField, value: Any) -> None:
    """Validate ``value`` (not None) against a model's declaration (the option record's own check), so the
    message reads like the core fields': ``SamplingParams.shift_scale=nan is invalid: must not be NaN``."""
    field.validate(value, where=f"{type(instance).__name__}.{field.name}")


def _check_model_fields(instance: SamplingParams, attribute: attrs.Attribute, values: dict) -> None:
    """Each model field must be declared by some registered pipeline and valid for (one of) its declarations;
    once the pipeline's ``check_sampling_params`` has set ``model_field_specs``, only its own declarations count."""
    if not isinstance(values, dict):
        _fail(instance, attribute, values, f"expected a dict, got {type(values).__name__}")
    if not values:
        return
    own = {f.name: [("", f)] for f in instance.model_field_specs}  # after the pipeline's check: its declarations
    declared = {**registered_sampling_fields(), **own} if set(values) - set(own) else own
    for name, value in values.items():
        if name not in declared:
            type(instance).check_keys({name: value})  # the unknown-field error, naming what is allowed
        error = None
        for _, field in declared[name]:
            try:
                check_sampling_field(instance, field, value)
                break
            except ConfigError as exc:
                error = error or exc
        else:
            raise error


@attrs.frozen(init=False)
class SamplingParams(_FromKwargs):
    """Prompt-independent generation knobs. ``None`` means "the model's default".

    Besides the core fields below, a keyword may name a sampling field a registered model declares (see
    :mod:`omni_core.sampling_fields`, e.g. a model's ``shift_scale``): it is validated against that
    declaration, stored in ``model_fields`` and read back as an attribute (``params.shift_scale``; a
    declared field that is unset reads None until the pipeline's check fills its default). They live beside
    ``extra_args``, not in it: they are typed and checked when the params are built, named like core fields
    in errors, CLI flags and HTTP bodies, and may key batches; ``extra_args`` stays the free-form options the
    pipeline alone reads.
    """

    height: int | None = attrs.field(default=None, validator=int_field(min=1, max=MAX_SIDE, optional=True))
    width: int | None = attrs.field(default=None, validator=int_field(min=1, max=MAX_SIDE, optional=True))
    num_frames: int | None = attrs.field(default=None, validator=int_field(min=1, max=MAX_FRAMES, optional=True))
    num_inference_steps: int | None = attrs.field(
        default=None, validator=int_field(min=1, max=MAX_INFERENCE_STEPS, optional=True))
    guidance_scale: float | None = attrs.field(default=None, validator=float_field(
        min=0.0, max=GUIDANCE_MAX, optional=True))
    seed: int | None = attrs.field(default=None, validator=int_field(min=0, max=2**63 - 1, optional=True))
    num_outputs_per_prompt: int = attrs.field(default=1, validator=int_field(min=1, max=MAX_OUTPUTS_PER_PROMPT))
    output_type: str = attrs.field(default="pil", validator=choice_field(OUTPUT_TYPES))
    max_sequence_length: int | None = attrs.field(default=None, validator=int_field(min=1, max=8192, optional=True))
    #: a LoRA adapter: a name from the engine's ``loras`` or a path to a .safetensors file (docs/lora.md)
    lora: str | None = attrs.field(default=None, validator=str_field(optional=True))
    #: how strongly the adapter applies (its update times this; 0 = the base model)
    lora_scale: float = attrs.field(default=1.0, validator=float_field(min=-LORA_SCALE_MAX, max=LORA_SCALE_MAX))
    #: model-specific options, checked by the pipeline
    extra_args: dict = attrs.field(factory=dict, converter=_dict_or_empty, validator=dict_field)
    #: values of model-declared sampling fields by name (None values are left out: unset means the default)
    model_fields: dict = attrs.field(factory=dict, converter=_dict_or_empty, validator=_check_model_fields)
    #: the declarations of the pipeline whose ``check_sampling_params`` produced these params (empty before):
    #: the schedulers key batches on those with ``splits_batch``
    model_field_specs: tuple = attrs.field(default=(), converter=tuple, eq=False)  # bookkeeping, not a value
    #: scheduling priority: lower runs first (as in vLLM); equal priorities run in arrival order (docs/scheduling.md)
    priority: int = attrs.field(default=0, validator=int_field(min=-(2**31), max=2**31 - 1))
    #: seconds from admission after which an unfinished request is aborted with a timeout error (None: no deadline)
    timeout: float | None = attrs.field(default=None, validator=float_field(min=0.001, max=7 * 86400.0, optional=True))
    #: an RL rollout: a stochastic flow step with per-sample log-probabilities (``RolloutOptions``; True: defaults)
    rollout: RolloutOptions | None = attrs.field(default=None, converter=coerce_rollout)

    #: fields set by the core or the pipeline's check, not by callers
    _INTERNAL = ("model_fields", "model_field_specs")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        core = {a.name for a in attrs.fields(type(self))}
        values = dict(kwargs.pop("model_fields", None) or {})
        for name in [k for k in kwargs if k not in core]:
            value = kwargs.pop(name)
            if value is None:
                values.pop(name, None)
            else:
                values[name] = value
        self.__attrs_init__(*args, model_fields=values, **kwargs)

    def __getattr__(self, name: str) -> Any:
        """A model field as an attribute: its value, else None when some pipeline declares it."""
        if name.startswith("_") or name in self._INTERNAL:
            raise AttributeError(name)
        values = self.model_fields
        if name in values:
            return values[name]
        if any(f.name == name for f in self.model_field_specs) or name in registered_sampling_fields():
            return None
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @classmethod
    def field_names(cls) -> list[str]:
        core = [n for n in super().field_names() if n not in cls._INTERNAL]
        return [*core, *(n for n in registered_sampling_fields() if n not in core)]

    def replace(self, **changes: Any) -> SamplingParams:
        self.check_keys(changes)
        return attrs.evolve(self, **changes)

"""``coerce_record``: the one ``coerce`` behind AttentionSpec, AttentionConfig, ParallelConfig, RequestLimits
and SequenceParallelPlan (instance as is, None as defaults, a string as the shorthand field, a dict by field
names; anything else refused, naming the field)."""

from __future__ import annotations

import pytest

from omni_core.config import AttentionConfig, AttentionSpec, ParallelConfig, RequestLimits, coerce_record
from omni_core.errors import ConfigError


@pytest.mark.parametrize("cls", [AttentionConfig, ParallelConfig, RequestLimits])
def test_instance_passes_through_and_none_is_the_defaults(cls):
    record = cls()
    assert cls.coerce(record) is record
    assert cls.coerce(None) == cls()


def test_string_sets_the_shorthand_field():
    assert AttentionSpec.coerce("FLASH_ATTN") == AttentionSpec(backend="FLASH_ATTN")
    assert AttentionConfig.coerce("FLASH_ATTN") == AttentionConfig(default=AttentionSpec(backend="FLASH_ATTN"))


def test_mapping_goes_through_from_kwargs():
    assert ParallelConfig.coerce({"ulysses_degree": 2}) == ParallelConfig(ulysses_degree=2)
    with pytest.raises(ConfigError, match="RequestLimits got an unknown field 'max_step'; did you mean 'max_steps'"):
        RequestLimits.coerce({"max_step": 2})


@pytest.mark.parametrize("coerce, value, field, message", [
    (AttentionSpec.coerce, None, "attention_config",
     "attention spec must be a backend name, a dict or AttentionSpec, got None"),
    (AttentionConfig.coerce, 3, "attention_config",
     "attention_config must be a dict, a backend name or AttentionConfig, got 3"),
    (ParallelConfig.coerce, "ulysses=2", "parallel_config",
     "parallel_config must be a dict or ParallelConfig, got 'ulysses=2'"),
    (RequestLimits.coerce, 5, "limits",
     "limits must be a dict such as {'max_steps': 200} or RequestLimits, got 5; fields: max_pixels, max_frames, "
     "max_steps, max_outputs, max_prompt_chars, max_image_pixels"),
])
def test_anything_else_is_refused_naming_the_field(coerce, value, field, message):
    with pytest.raises(ConfigError) as err:
        coerce(value)
    assert str(err.value) == message and err.value.field == field


def test_a_value_with_braces_is_quoted_as_it_is():
    with pytest.raises(ConfigError, match=r"got \[\{'a': 1\}\]$"):
        coerce_record(ParallelConfig, [{"a": 1}], field="parallel_config", error="x must be a dict, got {value!r}")


def test_sequence_parallel_plan_uses_it_with_its_aliases():
    from omni_core.attention.parallel.plan import SequenceParallelPlan

    plan = SequenceParallelPlan.coerce({"shard": {"x": 1}})
    assert SequenceParallelPlan.coerce(plan) is plan and plan.shard_inputs == {"x": 1}
    for bad in (None, "shard"):
        with pytest.raises(ConfigError) as err:
            SequenceParallelPlan.coerce(bad)
        assert str(err.value) == f"a sequence-parallel plan must be a dict or SequenceParallelPlan, got {bad!r}"
        assert err.value.field == "_sp_plan"

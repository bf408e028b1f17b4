"""Engine config and sampling params: validated on construction, errors name the field, value and what is allowed."""

from __future__ import annotations

import pytest

from omni_core.config import AttentionConfig, AttentionSpec, OmniDiffusionConfig, ParallelConfig, SamplingParams
from omni_core.errors import ConfigError


@pytest.fixture(autouse=True)
def _fresh_manager(omni_plugin_manager, monkeypatch):
    monkeypatch.delenv("OMNI_ATTENTION_BACKEND", raising=False)


def test_defaults():
    c = OmniDiffusionConfig(model="some/model")
    assert (c.dtype, c.cache_backend, c.max_num_seqs, c.world_size) == ("auto", "none", None, 1)
    assert (c.executor_name, c.scheduler_name) == ("uni", "request")
    stepped = OmniDiffusionConfig(model="m", streaming_output=True)
    assert stepped.uses_step_execution and stepped.scheduler_name == "step"
    assert OmniDiffusionConfig(model="m", parallel_config={"ulysses_degree": 2}).executor_name == "mp"


@pytest.mark.parametrize("value, expected", [("bf16", "bfloat16"), ("FP16", "float16"), ("float32", "float32"),
                                             ("half", "float16")])
def test_dtype_aliases(value, expected):
    assert OmniDiffusionConfig(model="m", dtype=value).dtype == expected


def test_torch_dtype_accepted():
    import torch

    assert OmniDiffusionConfig(model="m", dtype=torch.bfloat16).dtype == "bfloat16"


@pytest.mark.parametrize("kwargs, field, text", [
    ({"model": ""}, "model", "OmniDiffusionConfig.model='' is invalid: expected a non-empty string"),
    ({"model": "m", "dtype": "float64"}, "dtype", "unknown value 'float64'; allowed: auto, bfloat16, float16, float32"),
    ({"model": "m", "max_num_seqs": 0}, "max_num_seqs", "OmniDiffusionConfig.max_num_seqs=0 is invalid: must be >= 1"),
    ({"model": "m", "max_num_seqs": True}, "max_num_seqs", "expected an integer or None, got bool"),
    ({"model": "m", "step_execution": "yes"}, "step_execution", "expected True or False, got str"),
    ({"model": "m", "worker_start_timeout": float("nan")}, "worker_start_timeout", "must not be NaN"),
    ({"model": "m", "cache_config": [1]}, "cache_config", "expected a dict, got list"),
    ({"model": "m", "executor": "unii"}, "executor", "unknown executor 'unii'"),
    ({"model": "m", "scheduler": "stepp"}, "scheduler", "Did you mean 'step'?"),
    ({"model": "m", "platform": "cpuu"}, "platform", "Did you mean 'cpu'?"),
])
def test_engine_config_errors_name_the_field(kwargs, field, text):
    with pytest.raises(ConfigError) as err:
        OmniDiffusionConfig(**kwargs)
    assert err.value.field == field and text in str(err.value)


def test_unknown_cache_backend_lists_none_too():
    # "none" is a registered (built-in) cache backend, so it is listed among the allowed names
    with pytest.raises(ConfigError, match="unknown cache backend 'tea'; allowed: .*\\bnone\\b") as err:
        OmniDiffusionConfig(model="m", cache_backend="tea")
    assert err.value.field == "cache_backend"


def test_unknown_keyword_suggests():
    with pytest.raises(ConfigError, match="unknown field 'max_num_seq'; did you mean 'max_num_seqs'\\?") as err:
        OmniDiffusionConfig.from_kwargs(model="m", max_num_seq=4)
    assert err.value.field == "max_num_seq"
    with pytest.raises(ConfigError, match="did you mean 'num_inference_steps'"):
        SamplingParams.from_kwargs(num_inference_step=4)


def test_attention_shorthands():
    c = OmniDiffusionConfig.from_kwargs(model="m", attention_backend="TORCH_SDPA",
                                        attention_config={"per_role": {"cross": "TORCH_SDPA"}})
    assert c.attention_config.default == AttentionSpec(backend="TORCH_SDPA")
    assert c.attention_config.per_role == {"cross": AttentionSpec(backend="TORCH_SDPA")}
    assert AttentionConfig.coerce("TORCH_SDPA").default.backend == "TORCH_SDPA"
    spec = AttentionSpec.coerce({"backend": "TORCH_SDPA", "options": {"x": 1}})
    assert spec.options == {"x": 1}
    with pytest.raises(ConfigError, match="unknown field 'backnd'; did you mean 'backend'"):
        AttentionSpec.coerce({"backnd": "TORCH_SDPA"})
    with pytest.raises(ConfigError, match="per_role must map role -> backend"):
        AttentionConfig(per_role=["TORCH_SDPA"])
    with pytest.raises(ConfigError, match="attention_config must be a dict, a backend name or AttentionConfig"):
        AttentionConfig.coerce(3)


def test_parallel_config():
    p = ParallelConfig(ulysses_degree=2, ring_degree=2, cfg_parallel_size=2)
    assert (p.sequence_parallel_size, p.world_size) == (4, 8)
    assert p.requested_strategies() == ["ulysses", "ring", "cfg"]
    with pytest.raises(ConfigError, match="ParallelConfig.cfg_parallel_size=3 is invalid: must be <= 2") as err:
        ParallelConfig(cfg_parallel_size=3)
    assert err.value.field == "cfg_parallel_size"
    with pytest.raises(ConfigError, match="unknown field 'ulysses'; did you mean 'ulysses_degree'"):
        ParallelConfig.coerce({"ulysses": 2})


def test_sampling_params():
    p = SamplingParams(height=64, width=64, num_inference_steps=4, seed=0)
    assert p.replace(seed=1).seed == 1 and p.seed == 0
    assert SamplingParams().output_type == "pil"
    with pytest.raises(ConfigError, match="unknown field 'sed'; did you mean 'seed'"):
        p.replace(sed=1)
    for kwargs, field in [({"height": 0}, "height"), ({"num_inference_steps": 1001}, "num_inference_steps"),
                          ({"guidance_scale": -1.0}, "guidance_scale"), ({"num_outputs_per_prompt": 17},
                                                                         "num_outputs_per_prompt"),
                          ({"output_type": "png"}, "output_type"), ({"seed": -1}, "seed"),
                          ({"width": 1.5}, "width")]:
        with pytest.raises(ConfigError) as err:
            SamplingParams(**kwargs)
        assert err.value.field == field and f"SamplingParams.{field}" in str(err.value)


@pytest.mark.parametrize("field", ["guidance_scale", "guidance_scale_2", "true_cfg_scale"])
@pytest.mark.parametrize("value, text", [
    (float("inf"), "=inf is invalid: must be finite (allowed: 0.0 to 100.0)"),
    (float("-inf"), "=-inf is invalid: must be finite (allowed: 0.0 to 100.0)"),
    (float("nan"), "=nan is invalid: must not be NaN"),
    (1e308, "=1e+308 is invalid: must be <= 100.0 and >= 0.0"),
    (100.5, "=100.5 is invalid: must be <= 100.0 and >= 0.0"),
    (-0.5, "=-0.5 is invalid: must be >= 0.0 and <= 100.0"),
])
def test_guidance_scales_must_be_finite_and_in_range(field, value, text):
    with pytest.raises(ConfigError) as err:
        SamplingParams(**{field: value})
    assert err.value.field == field and f"SamplingParams.{field}{text}" in str(err.value)


@pytest.mark.parametrize("value", [0.0, 1, 7.5, 100.0])
def test_guidance_scales_in_range_are_kept(value):
    p = SamplingParams(guidance_scale=value, guidance_scale_2=value, true_cfg_scale=value)
    assert (p.guidance_scale, p.guidance_scale_2, p.true_cfg_scale) == (value, value, value)


@pytest.mark.parametrize("prompt", ["", " ", "\n\t  ", {"prompt": ""}, {"prompt": "  ", "negative_prompt": "x"}])
def test_empty_prompt_is_refused_by_the_python_api(prompt):
    from omni_core.entrypoints.common import build_requests

    with pytest.raises(ConfigError, match="prompt must not be empty or whitespace only") as err:
        build_requests(prompt, SamplingParams())
    assert err.value.field == "prompt"


def test_empty_negative_prompt_is_fine():
    from omni_core.entrypoints.common import build_requests

    (req,) = build_requests({"prompt": "a cat", "negative_prompt": ""}, SamplingParams())
    assert (req.prompt, req.negative_prompt) == ("a cat", "")


def test_configs_are_frozen_and_serialisable():
    c = OmniDiffusionConfig(model="m")
    with pytest.raises(AttributeError):
        c.model = "other"  # type: ignore[misc]
    d = c.to_dict()
    assert d["model"] == "m" and d["parallel_config"]["ulysses_degree"] == 1

"""tea_cache with only this plugin installed: registration through the entry point, config errors naming the
field, and a denoiser it has no extractor for. Tests that run it on a model plugin live in the repository's
tests/combos/."""

from __future__ import annotations

import pytest
import torch

from omni_core.errors import ConfigError


# ---------------------------------------------------------------------------------------------- registration
def test_registered_through_entry_point():
    from omni_core.plugins.manager import get_plugin_manager

    spec = get_plugin_manager().get_component("cache", "tea_cache")
    assert spec.provider == "omni-cache-teacache"
    assert spec.load().name == "tea_cache"


@pytest.mark.parametrize("config, field", [
    ({"rel_l1": 0.1}, "cache_config.rel_l1"),
    ({"rel_l1_thresh": -1}, "cache_config.rel_l1_thresh"),
    ({"rel_l1_thresh": "high"}, "cache_config.rel_l1_thresh"),
    ({"coefficients": "1,2"}, "cache_config.coefficients"),
    ({"coefficients": []}, "cache_config.coefficients"),
    ({"warmup_steps": 1.5}, "cache_config.warmup_steps"),
    ({"max_consecutive_reuse": 0}, "cache_config.max_consecutive_reuse"),
])
def test_bad_cache_config_names_the_field(config, field):
    from omni_cache_teacache.backend import TeaCacheBackend

    with pytest.raises(ConfigError) as err:
        TeaCacheBackend(config)
    assert err.value.field == field
    assert field.split(".")[1] in str(err.value)
    if field == "cache_config.rel_l1":
        assert "did you mean 'rel_l1_thresh'" in str(err.value) and "warmup_steps" in str(err.value)


def test_unsupported_denoiser_is_refused_clearly():
    from omni_cache_teacache.backend import TeaCacheBackend

    class Toy:
        transformer = torch.nn.Linear(2, 2)

    with pytest.raises(ConfigError, match="no extractor for Linear; supported denoisers: QwenImageTransformer2DModel"):
        TeaCacheBackend({}).enable(Toy())

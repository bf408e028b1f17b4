"""cache_dit with only this plugin installed: registration through the entry point and config errors naming the
field. Tests that run it on a model plugin live in the repository's tests/combos/."""

from __future__ import annotations

import pytest

from omni_core.errors import ConfigError


# ---------------------------------------------------------------------------------------------- registration
def test_registered_through_entry_point():
    from omni_core.plugins.manager import get_plugin_manager

    spec = get_plugin_manager().get_component("cache", "cache_dit")
    assert spec.provider == "omni-cache-dit" and spec.requires == ("cache_dit",)
    cls = spec.load()
    assert cls.name == "cache_dit" and cls.is_available() == (True, "")


@pytest.mark.parametrize("config, field", [
    ({"threshold": 0.1}, "cache_config.threshold"),
    ({"residual_diff_threshold": -0.1}, "cache_config.residual_diff_threshold"),
    ({"Fn_compute_blocks": 0}, "cache_config.Fn_compute_blocks"),
    ({"max_warmup_steps": "4"}, "cache_config.max_warmup_steps"),
    ({"enable_taylorseer": 1}, "cache_config.enable_taylorseer"),
    ({"scm_steps_mask_policy": "turbo"}, "cache_config.scm_steps_mask_policy"),
])
def test_bad_cache_config_names_the_field(config, field):
    from omni_cache_dit.backend import CacheDiTBackend

    with pytest.raises(ConfigError) as err:
        CacheDiTBackend(config)
    assert err.value.field == field
    assert "residual_diff_threshold" in str(err.value) or field.split(".")[1] in str(err.value)

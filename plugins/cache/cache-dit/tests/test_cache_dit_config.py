"""cache_dit with only this plugin installed: registration through the entry point and config errors naming the
field, from the backend and from ``check_config`` in the engine's process before any worker starts (with the ``mp``
executor too). Tests on a model: test_cache_dit_tiny.py (the core's tiny DiT) and the repository's tests/combos/."""

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

    for check in (CacheDiTBackend, CacheDiTBackend.check_config):
        with pytest.raises(ConfigError) as err:
            check(config)
        assert err.value.field == field
        assert "residual_diff_threshold" in str(err.value) or field.split(".")[1] in str(err.value)


def test_good_cache_config_passes_the_check():
    from omni_cache_dit.backend import CacheDiTBackend

    CacheDiTBackend.check_config({"residual_diff_threshold": 0.3, "Fn_compute_blocks": 2, "enable_taylorseer": True,
                                  "scm_steps_mask_policy": "fast"})


@pytest.mark.parametrize("executor", ["uni", "mp"])
def test_engine_refuses_a_bad_key_before_any_worker_starts(tiny_dit_model, executor):
    import multiprocessing

    from omni_core import Omni

    before = set(multiprocessing.active_children())
    with pytest.raises(ConfigError, match="'bogus' is not a cache_dit option") as err:
        Omni(tiny_dit_model, executor=executor, warmup=False, cache_backend="cache_dit", cache_config={"bogus": 1})
    assert err.value.field == "cache_config.bogus"
    assert set(multiprocessing.active_children()) == before

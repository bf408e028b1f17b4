"""tea_cache with only this plugin installed: registration through the entry point, config errors naming the
field (in the engine's process through ``check_config`` too), and pipelines whose specs it cannot use. Tests that
run it on a model plugin live in the repository's tests/combos/; on the core's tiny DiT: test_teacache_tiny.py."""

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
@pytest.mark.parametrize("where", ["check_config", "constructor"])
def test_bad_cache_config_names_the_field(config, field, where):
    from omni_cache_teacache.backend import TeaCacheBackend

    with pytest.raises(ConfigError) as err:
        TeaCacheBackend.check_config(config) if where == "check_config" else TeaCacheBackend(config)
    assert err.value.field == field
    assert field.split(".")[1] in str(err.value)
    if field == "cache_config.rel_l1":
        assert "did you mean 'rel_l1_thresh'" in str(err.value)
        assert all(k in str(err.value) for k in ("rel_l1_thresh", "coefficients", "warmup_steps",
                                                  "max_consecutive_reuse"))


def test_good_cache_config_passes_check():
    from omni_cache_teacache.backend import TeaCacheBackend

    TeaCacheBackend.check_config({})
    TeaCacheBackend.check_config({"rel_l1_thresh": 0.2, "coefficients": [1, 0], "warmup_steps": 2,
                                  "max_consecutive_reuse": 3})


class _Block(torch.nn.Module):
    def forward(self, hidden, temb):
        return hidden + temb


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Block()])


def _pipeline(**spec_kwargs):
    from omni_core.pipelines.denoiser import DenoiserSpec

    net = _Net()
    kwargs = dict(name="transformer", module=net, blocks_attr="blocks", block_params=("hidden", "temb"),
                  carried="hidden", block_outputs="hidden", residual_stream="hidden", side_inputs="temb",
                  modulated_input=lambda module, block, a: a["hidden"])
    kwargs.update(spec_kwargs)

    class Pipeline:
        def denoisers(self):
            return [DenoiserSpec(**kwargs)]

    return Pipeline()


def test_pipeline_without_specs_is_refused_clearly():
    from omni_cache_teacache.backend import TeaCacheBackend

    class Toy:
        transformer = torch.nn.Linear(2, 2)

    with pytest.raises(ConfigError, match="Toy declares no denoisers"):
        TeaCacheBackend({}).enable(Toy())


def test_spec_without_modulated_input_is_refused_clearly():
    from omni_cache_teacache.backend import TeaCacheBackend

    with pytest.raises(ConfigError, match="'transformer' denoiser of Pipeline declares no modulated_input") as err:
        TeaCacheBackend({}).enable(_pipeline(modulated_input=None))
    assert err.value.field == "modulated_input"


def test_spec_whose_blocks_take_other_parameters_is_refused():
    from omni_cache_teacache.backend import TeaCacheBackend

    with pytest.raises(ConfigError, match=r"_Block.forward takes \['hidden', 'temb'\]") as err:
        TeaCacheBackend({}).enable(_pipeline(block_params=("x", "temb"), carried="x", block_outputs="x",
                                             residual_stream="x"))
    assert err.value.field == "block_params"


def test_invalid_shipped_defaults_name_the_denoiser_and_field():
    from omni_cache_teacache.backend import TeaCacheBackend

    with pytest.raises(ConfigError, match="'transformer' denoiser's shipped tea_cache defaults") as err:
        TeaCacheBackend({}).enable(_pipeline(cache_defaults={"tea_cache": {"rel_l1_thresh": -2}}))
    assert err.value.field == "cache_config.rel_l1_thresh"


def test_settings_layer_user_over_spec_over_generic():
    """A spec's shipped defaults fill what the user leaves out; a spec that ships none runs the raw change."""
    from omni_cache_teacache.backend import TeaCacheBackend
    from omni_cache_teacache.config import GENERIC_DEFAULTS

    shipped = _pipeline(cache_defaults={"tea_cache": {"coefficients": (2.0, 0.0), "rel_l1_thresh": 0.3,
                                                      "warmup_steps": 0}})
    backend = TeaCacheBackend({"rel_l1_thresh": 0.05})
    backend.enable(shipped)
    opts = backend.denoisers["transformer"].options
    assert (opts.coefficients, opts.rel_l1_thresh, opts.warmup_steps) == ((2.0, 0.0), 0.05, 1)  # warm-up >= 1
    backend.disable()
    backend = TeaCacheBackend({})
    backend.enable(_pipeline())
    opts = backend.denoisers["transformer"].options
    assert (opts.coefficients, opts.rel_l1_thresh) == (GENERIC_DEFAULTS.coefficients, GENERIC_DEFAULTS.rel_l1_thresh)
    backend.disable()

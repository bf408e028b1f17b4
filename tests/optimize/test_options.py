"""The memory/speed options as engine fields and CLI flags: bad values are ConfigErrors naming the field and the
allowed values, before any model is loaded; the flags reach ``OmniDiffusionConfig``."""

from __future__ import annotations

import argparse

import pytest

from omni_core.config import OmniDiffusionConfig
from omni_core.errors import ConfigError


@pytest.mark.parametrize("field, value, match", [
    ("offload", "disk", "allowed: group, model, none"),
    ("performance_mode", "fast", "allowed: auto, memory, speed"),
    ("compile", "yes", "True or False"),
    ("vae_tiling", 256, "True, False or a dict"),
    ("quantize_components", [], "component names"),
])
def test_bad_values_name_the_field(field, value, match):
    with pytest.raises(ConfigError, match=match) as exc:
        OmniDiffusionConfig(model="shapes", **{field: value})
    assert exc.value.field == field


def test_cli_flags_reach_the_config():
    from omni_core.cli.options import add_engine_options, engine_options

    p = argparse.ArgumentParser()
    add_engine_options(p)
    args = p.parse_args(["--quantization", "int8", "--quantize-components", "denoiser,text_encoder", "--offload",
                         "group", "--vae-tiling", '{"tile_sample_min_height": 64}', "--vae-slicing", "--compile",
                         "--performance-mode", "memory"])
    config = OmniDiffusionConfig(model="shapes", **engine_options(args))
    assert (config.quantization, config.quantize_components, config.offload) == (
        "int8", ("denoiser", "text_encoder"), "group")
    assert config.vae_tiling == {"tile_sample_min_height": 64} and config.vae_slicing and config.compile
    assert config.performance_mode == "memory"
    plain = OmniDiffusionConfig(model="shapes", **engine_options(p.parse_args(["--vae-tiling"])))
    assert plain.vae_tiling is True and plain.compile is None and plain.quantization is None

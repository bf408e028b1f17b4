"""The ray executor's options: reach the executor through ``Omni(...)`` keywords and the CLI, and bad ones
fail before anything starts, naming the field and what is allowed (no Ray cluster needed)."""

from __future__ import annotations

import pytest

from omni_core.config import OmniDiffusionConfig
from omni_core.errors import ConfigError


def test_ray_keywords_become_executor_options():
    config = OmniDiffusionConfig.from_kwargs(model="shapes", executor="ray", ray_address="auto",
                                             ray_placement="pack")
    assert config.executor_options == {"address": "auto", "placement": "pack"}


def test_ray_option_without_the_ray_executor_names_it():
    with pytest.raises(ConfigError, match="ray_address is an option of executor 'ray'") as info:
        OmniDiffusionConfig.from_kwargs(model="shapes", executor="mp", ray_address="auto")
    assert info.value.field == "ray_address"


@pytest.mark.parametrize("kwargs, field, allowed", [
    ({"ray_placement": "everywhere"}, "ray_placement", "allowed: pack, spread"),
    ({"ray_cpus_per_rank": 0}, "ray_cpus_per_rank", "> 0.0"),
    ({"ray_address": ""}, "ray_address", "'auto'"),
    ({"executor_options": {"adress": "auto"}}, "executor_options", "ray_address"),
])
def test_bad_options_are_refused_before_start(kwargs, field, allowed):
    with pytest.raises(ConfigError, match=allowed) as info:
        OmniDiffusionConfig.from_kwargs(model="shapes", executor="ray", **kwargs)
    assert info.value.field == field


def test_cli_flags(tmp_path):
    import argparse

    from omni_core.cli.options import add_engine_options, engine_options

    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    assert "--ray-address" in parser.format_help()
    args = parser.parse_args(["--executor", "ray", "--ray-address", "auto", "--ray-cpus-per-rank", "0.5"])
    opts = engine_options(args)
    config = OmniDiffusionConfig.from_kwargs(model="shapes", **opts)
    assert config.executor == "ray" and config.executor_options == {"address": "auto", "cpus_per_rank": 0.5}

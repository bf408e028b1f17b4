"""The one option record (``omni_core.options.Option``): its check, CLI flag, JSON schema and docs line come from
the record; ``validate_options`` names an unknown key (closest name, every allowed one) and a bad value; the real
plugins (tea_cache, cache_dit, ray) declare theirs on their records, so the config refuses a wrong one by name and
``omni env`` / ``--help`` list them."""

from __future__ import annotations

import argparse
import json
import pickle

import pytest

from omni_core.errors import ConfigError
from omni_core.options import Option, validate_options


def _even(value: int) -> str | None:
    return None if value % 2 == 0 else "must be even"


OPTS = (
    Option(name="threshold", type="float", min=0, default=0.25, help="reuse below it"),
    Option(name="steps", type="int", min=1, max=8, check=_even, allowed="an even integer in [2, 8]"),
    Option(name="coefficients", type="floats", help="highest power first"),
    Option(name="policy", type="choice", choices=("slow", "fast"), default="slow"),
    Option(name="taylor", type="bool", default=False),
)


# ---------------------------------------------------------------------------------------------- declaration
@pytest.mark.parametrize("kwargs, text", [
    ({"name": "x", "type": "list"}, "type='list' is invalid; allowed: float, int, bool, str, choice, floats"),
    ({"name": "x", "type": "int", "check": lambda v: None}, "check must be a module-level function"),
    ({"name": "x", "type": "int", "min": 1, "default": 0}, "default=0 is refused by its own check: must be >= 1"),
    ({"name": "x", "type": "int", "check": _even, "default": 3}, "must be even"),
])
def test_a_bad_declaration_is_refused(kwargs, text):
    with pytest.raises(ValueError, match=text):
        Option(**kwargs)


def test_records_cross_processes():
    assert pickle.loads(pickle.dumps(OPTS)) == OPTS  # a custom check is a module-level function


# ---------------------------------------------------------------------------------------------- validate_options
def test_unknown_key_names_the_prefixed_field_the_closest_and_every_allowed_key_with_help():
    with pytest.raises(ConfigError) as err:
        validate_options({"threshhold": 0.1}, OPTS, prefix="cache_config.", owner="a demo option")
    text = str(err.value)
    assert err.value.field == "cache_config.threshhold"
    assert text.startswith("cache_config.threshhold: 'threshhold' is not a demo option (did you mean 'threshold'?)")
    assert "threshold (a number >= 0, default 0.25: reuse below it)" in text
    assert all(o.name in text.split("allowed:")[1] for o in OPTS)


def test_an_executor_style_prefix_is_part_of_every_name():
    with pytest.raises(ConfigError) as err:
        validate_options({"stps": 2}, OPTS, prefix="demo_", owner="an option of executor 'demo'")
    assert err.value.field == "demo_stps" and "(did you mean 'demo_steps'?)" in str(err.value)
    assert "demo_coefficients (a list of numbers" in str(err.value)


@pytest.mark.parametrize("values, field, text", [
    ({"threshold": -1}, "x.threshold", "x.threshold=-1 is invalid: must be >= 0; allowed: a number >= 0 (reuse below it)"),
    ({"threshold": float("nan")}, "x.threshold", "must not be NaN"),
    ({"threshold": True}, "x.threshold", "expected a number, got bool"),
    ({"steps": 3}, "x.steps", "x.steps=3 is invalid: must be even (allowed: an even integer in [2, 8])"),
    ({"steps": 10}, "x.steps", "must be <= 8 and >= 1 (allowed: an even integer in [2, 8])"),
    ({"coefficients": "1,0"}, "x.coefficients", "expected a non-empty list of numbers"),
    ({"coefficients": [1, "a"]}, "x.coefficients", "item 1: expected a number, got str"),
    ({"policy": "fsat"}, "x.policy", "x.policy: unknown value 'fsat'; allowed: fast, slow. Did you mean 'fast'?"),
    ({"taylor": 1}, "x.taylor", "expected True or False, got int"),
])
def test_a_bad_value_names_the_field_and_what_is_allowed(values, field, text):
    with pytest.raises(ConfigError) as err:
        validate_options(values, OPTS, prefix="x.", owner="a demo option")
    assert err.value.field == field and text in str(err.value), str(err.value)


def test_defaults_fill_unset_and_values_are_normalised():
    out = validate_options({"threshold": 1, "coefficients": [1, 0], "steps": None}, OPTS, prefix="x.", owner="o")
    assert out == {"threshold": 1.0, "steps": None, "coefficients": (1.0, 0.0), "policy": "slow", "taylor": False}
    assert isinstance(out["threshold"], float)


# ---------------------------------------------------------------------------------------------- derived views
def test_cli_flags_come_from_the_record():
    parser = argparse.ArgumentParser()
    for o in OPTS:
        parser.add_argument(o.flag, dest=o.name, default=None, **o.cli_kwargs())
    args = parser.parse_args(["--threshold", "0.5", "--steps", "4", "--coefficients", "1,0.5", "--policy", "fast",
                              "--no-taylor"])
    assert vars(args) == {"threshold": 0.5, "steps": 4, "coefficients": [1.0, 0.5], "policy": "fast", "taylor": False}
    assert validate_options(vars(args), OPTS, prefix="x.", owner="o")["coefficients"] == (1.0, 0.5)
    with pytest.raises(SystemExit):
        parser.parse_args(["--policy", "medium"])


def test_json_schema_and_docs_line_come_from_the_record():
    threshold, steps, coefficients, policy, _ = OPTS
    assert threshold.json_schema() == {"type": "number", "minimum": 0, "default": 0.25, "description": "reuse below it"}
    assert steps.json_schema() == {"type": "integer", "minimum": 1, "maximum": 8}
    assert coefficients.json_schema()["items"] == {"type": "number"}
    assert policy.json_schema() == {"type": "string", "enum": ["slow", "fast"], "default": "slow"}
    assert threshold.describe() == "a number >= 0, default 0.25: reuse below it"
    assert steps.describe() == "an even integer in [2, 8]"
    assert json.dumps([o.to_dict() for o in OPTS])  # what omni env --json lists


# ---------------------------------------------------------------------------------------------- the real plugins
@pytest.mark.parametrize("backend, config, field, text", [
    ("tea_cache", {"rel_l1": 0.1}, "cache_config.rel_l1", "did you mean 'rel_l1_thresh'?"),
    ("tea_cache", {"coefficients": []}, "cache_config.coefficients", "expected a non-empty list of numbers"),
    ("cache_dit", {"Fn_compute_block": 2}, "cache_config.Fn_compute_block", "did you mean 'Fn_compute_blocks'?"),
    ("cache_dit", {"scm_steps_policy": "sometimes"}, "cache_config.scm_steps_policy", "allowed: dynamic, static"),
])
def test_the_config_refuses_a_wrong_cache_option_by_name(backend, config, field, text):
    """Checked from the backend's record when the config is built: no model, no backend class, no worker."""
    from omni_core.config import OmniDiffusionConfig

    with pytest.raises(ConfigError) as err:
        OmniDiffusionConfig(model="shapes", cache_backend=backend, cache_config=config)
    assert err.value.field == field and text in str(err.value), str(err.value)
    OmniDiffusionConfig(model="shapes", cache_backend=backend, cache_config={})


def test_plugins_declare_their_options_on_their_records():
    from omni_core.config import declared_options

    caches, executors = declared_options("cache"), declared_options("executor")
    assert [o.name for o in caches["tea_cache"]] == ["rel_l1_thresh", "coefficients", "warmup_steps",
                                                     "max_consecutive_reuse"]
    assert "residual_diff_threshold" in [o.name for o in caches["cache_dit"]]
    assert "address" in [o.name for o in executors["ray"]]


def test_ray_address_has_a_custom_check():
    from omni_core.config import OmniDiffusionConfig

    with pytest.raises(ConfigError) as err:
        OmniDiffusionConfig.from_kwargs(model="shapes", executor="ray", ray_address="somewhere")
    assert err.value.field == "ray_address" and "not a Ray address (allowed: None, 'auto'" in str(err.value)
    assert OmniDiffusionConfig.from_kwargs(model="shapes", executor="ray", ray_address="10.0.0.1:6379")


def test_env_and_help_list_the_cache_options(capsys):
    from omni_core.cli.main import main

    assert main(["env", "--json"]) == 0
    env = json.loads(capsys.readouterr().out)
    caches = {row["name"]: row for row in env["cache_backends"]}
    tea = {o["name"]: o for o in caches["tea_cache"]["options"]}
    assert tea["rel_l1_thresh"]["allowed"] == "a number >= 0" and "reuse while" in tea["rel_l1_thresh"]["help"]
    assert {o["name"]: o["default"] for o in caches["cache_dit"]["options"]}["residual_diff_threshold"] == 0.24
    ray = {e["name"]: e for e in env["executors"]}["ray"]
    assert {o["name"] for o in ray["options"]} >= {"address", "placement"}
    assert main(["env"]) == 0
    text = capsys.readouterr().out
    assert "      rel_l1_thresh: a number >= 0: reuse while" in text and "      ray_placement: one of" in text
    for command in ("generate", "serve"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        helptext = " ".join(capsys.readouterr().out.split())
        assert "tea_cache: rel_l1_thresh (a number >= 0)" in helptext, command
        assert "cache_dit: Fn_compute_blocks (an integer >= 1)" in helptext, command
        assert "--ray-cpus-per-rank FLOAT" in helptext, command

"""Several models within a budget (``omni_core.engine.fleet``, ``omni_core.config.fleet``): what is refused before
any model loads (a models file's values, a model too big alone, options that cannot combine), and the contention
policies (fail at once naming the models that hold the budget; wait, then fail; a pinned model never evicted;
a waiting model drains a busy one and gets in). The server under load: tests/serve/test_fleet.py."""

from __future__ import annotations

import json
import time

import pytest

from omni_core.config.fleet import FleetConfig, Residency, parse_bytes
from omni_core.errors import ConfigError, ResidencyError
from omni_core.request import OmniDiffusionRequest

SHAPES = {"warmup": False, "limits": {"max_steps": 1000}, "streaming_output": False}


def request(steps: int = 2, seed: int = 0) -> OmniDiffusionRequest:
    from omni_core.config import SamplingParams

    return OmniDiffusionRequest(prompt="a red circle", sampling_params=SamplingParams(
        seed=seed, num_inference_steps=steps, height=64, width=64))


def test_a_models_file_in_toml_or_json_with_its_residency(tmp_path):
    toml = tmp_path / "models.toml"
    toml.write_text('[residency]\ndevice_budget = "1.5GiB"\ncontention = "fail"\n\n'
                    '[[models]]\nname = "img"\nmodel = "shapes"\npinned = true\ncache_backend = "tea_cache"\n\n'
                    '[[models]]\nmodel = "/models/wan"\nworking_memory = "512MiB"\n')
    config = FleetConfig.from_file(str(toml), common={"warmup": False}, host_budget="2GB")
    assert config.names == ["img", "/models/wan"]
    assert config.residency == Residency(device_budget=int(1.5 * (1 << 30)), host_budget=2 * 10 ** 9,
                                         contention="fail")
    img, wan = config.models
    assert img.pinned and img.options == {"warmup": False, "cache_backend": "tea_cache"}
    assert wan.working_memory == 512 << 20 and not wan.pinned
    js = tmp_path / "models.json"
    js.write_text(json.dumps({"models": [{"name": "a", "model": "shapes"}], "residency": {"restart": "never"}}))
    assert FleetConfig.from_file(str(js)).residency.restart == "never"


@pytest.mark.parametrize("bad, field, says", [
    ({"residency": {"device_budget": "2 parsecs"}}, "device_budget", "GiB"),
    ({"residency": {"contention": "maybe"}}, "contention", "fail, wait"),
    ({"residency": {"restart": "always"}}, "restart", "never, on_request"),
    ({"residency": {"wait_timeout": 3}}, "wait_timeout", "wait_timeout_s"),
    ({"models": [{"name": "a", "model": "shapes"}, {"name": "a", "model": "shapes"}]}, "name", "distinct"),
    ({"models": [{"name": "a"}]}, "model", "no 'model'"),
    ({"models": [{"name": "a b", "model": "shapes"}]}, "name", "without whitespace"),
    ({"models": [], "extra": 1}, "models_file", "allowed: models, residency"),
])
def test_a_bad_models_file_is_refused_naming_the_field(tmp_path, bad, field, says):
    path = tmp_path / "models.json"
    path.write_text(json.dumps({"models": [{"model": "shapes"}], **bad}))
    with pytest.raises(ConfigError) as err:
        FleetConfig.from_file(str(path))
    assert err.value.field == field and says in str(err.value), str(err.value)


def test_sizes_read_as_people_write_them():
    assert parse_bytes("512MiB", "f") == 512 << 20 and parse_bytes("2GB", "f") == 2 * 10 ** 9
    assert parse_bytes(1024, "f") == 1024 and parse_bytes(None, "f") is None
    for bad in (-1, True, "lots", "1.5 XB"):
        with pytest.raises(ConfigError):
            parse_bytes(bad, "f")


def test_refused_at_start_a_model_too_big_alone_and_options_that_cannot_combine(tmp_path):
    from omni_core.engine.fleet import ModelFleet
    from omni_core.testing.diffusers_folders import build_tiny_qwen_image

    folder = build_tiny_qwen_image(tmp_path / "qwen")
    config = FleetConfig.from_specs([f"qwen={folder}", "img=shapes"], {"device_budget": "1MB"})
    with pytest.raises(ConfigError, match=r"model 'qwen' cannot fit the device budget alone: \d+ bytes") as err:
        ModelFleet(config)
    assert err.value.field == "device_budget" and "device_budget=1000000" in str(err.value)
    both = FleetConfig.from_specs([{"name": "img", "model": "shapes", "offload": "model",
                                    "parallel_config": {"ulysses_degree": 2}}])
    with pytest.raises(ConfigError, match=r"model 'img': offload='model' with parallel_config ulysses"):
        ModelFleet(both)
    with pytest.raises(ConfigError, match="executor='uni'.*several models"):
        ModelFleet(FleetConfig.from_specs([{"name": "a", "model": "shapes", "executor": "uni"}, "b=shapes"]))


@pytest.fixture(scope="module")
def two_shapes():
    """What one shapes model charges before its first load (its weight files, which hold a little more than its
    pipeline does, so the same figure once measured fits too): a budget of this holds one model, never two."""
    from omni_core.engine.fleet import ModelFleet

    (estimated,) = ModelFleet(FleetConfig.from_specs(["a=shapes"], common=SHAPES)).states()  # plans, loads nothing
    return estimated["weight_bytes"] + estimated["working_bytes"]


def fleet_of(charge: int, **residency):
    from omni_core.engine.client import start_fleet

    models = [{"name": "a", "model": "shapes", "pinned": residency.pop("pin_a", False)}, "b=shapes"]
    return start_fleet(FleetConfig.from_specs(models, {"device_budget": charge + 1, **residency}, common=SHAPES))


def test_fail_at_once_names_the_model_that_holds_the_budget_and_waiting_drains_it(two_shapes):
    fleet = fleet_of(two_shapes, contention="fail")
    try:
        members = fleet.members()
        (busy,) = members["a"].submit([request(steps=300)])
        started = time.monotonic()
        with pytest.raises(ResidencyError, match=r"model 'b' cannot be brought onto the device at once .*: a") as err:
            members["b"].submit([request()])
        assert err.value.holders == ["a"] and time.monotonic() - started < 5
        busy.abort()
        assert busy.result(timeout=30).status == "aborted"
    finally:
        fleet.close()
    fleet = fleet_of(two_shapes, contention="wait", wait_timeout_s=60)
    try:
        members = fleet.members()
        (busy,) = members["a"].submit([request(steps=20)])
        (waited,) = members["b"].submit([request(seed=3)])  # waits for a to drain, then a is evicted
        assert busy.result(timeout=60).status == "completed" and waited.result(timeout=60).status == "completed"
        states = {s["name"]: s["state"] for s in fleet.states()}
        assert states == {"a": "host", "b": "device"}, states
    finally:
        fleet.close()


def test_a_pinned_model_is_never_evicted_waiting_ends_naming_it(two_shapes):
    fleet = fleet_of(two_shapes, contention="wait", wait_timeout_s=0.5, pin_a=True)
    try:
        assert {s["name"]: s["state"] for s in fleet.states()}["a"] == "device"  # pinned: loaded at start
        started = time.monotonic()
        with pytest.raises(ResidencyError, match=r"within wait_timeout_s=0.5.*pinned: a") as err:
            fleet.members()["b"].submit([request()])
        assert 0.5 <= time.monotonic() - started < 10 and err.value.holders == ["a"]
        assert {s["name"]: s["state"] for s in fleet.states()}["a"] == "device"
    finally:
        fleet.close()


def test_a_model_whose_files_do_not_tell_its_size_is_measured_at_start(monkeypatch, two_shapes):
    """A model without weight files (so no estimate) is loaded once at start and measured: too big alone, it is
    refused then (not at its first request); else it waits in host memory with its measured size."""
    import omni_core.engine.fleet as fleet_module
    from omni_core.engine.client import start_fleet

    monkeypatch.setattr(fleet_module, "weight_file_bytes", lambda folder: 0)
    with pytest.raises(ConfigError, match=r"model 'a' cannot fit the device budget alone: \d+ bytes of weights "
                                          r"\(its pipeline, measured\)"):
        start_fleet(FleetConfig.from_specs(["a=shapes", "b=shapes"], {"device_budget": 1000}, common=SHAPES))
    fleet = start_fleet(FleetConfig.from_specs(["a=shapes"], {"device_budget": two_shapes + 1}, common=SHAPES))
    try:
        (state,) = fleet.states()
        assert state["measured"] and state["state"] == "host" and state["weight_bytes"] > 1_000_000, state
    finally:
        fleet.close()


def test_with_restart_never_a_dead_model_stays_reported_dead_and_the_other_serves(two_shapes):
    import os
    import signal

    from omni_core.errors import EngineDeadError

    fleet = fleet_of(two_shapes * 2, restart="never")
    try:
        members = fleet.members()
        assert members["a"].submit([request()])[0].result(timeout=60).status == "completed"
        (worker,) = fleet.slot("a").engine.executor.worker_pids()
        os.kill(worker, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not members["a"].is_dead:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with pytest.raises(EngineDeadError, match=r"model 'a': .*exited with code -9"):
            members["a"].submit([request()])
        assert {s["name"]: s["state"] for s in fleet.states()}["a"] == "dead"
        assert members["b"].submit([request()])[0].result(timeout=60).status == "completed"
    finally:
        fleet.close()

"""Requests through the diffusers backend: aborts land within a step, the call's own parameters are reachable
(``extra_args``) and checked against its signature before any work, and folders Omni will not run are refused with
the reason and the fix before any weight is read."""

from __future__ import annotations

import json
import os
import shutil
import threading

import pytest
import torch

from omni_model_diffusers.parity import omni_fields, reference, reference_call
from omni_model_diffusers.testing import FAMILIES, example_image


@pytest.fixture(scope="module")
def sd_engine(family):
    from omni_core import Omni

    with Omni(family("sd"), warmup=False, cpu_threads=1) as omni:
        yield omni


def test_abort_lands_within_a_step(sd_engine):
    from omni_core.config import SamplingParams
    from omni_core.request import OmniDiffusionRequest
    from omni_core.testing.contract_helpers import final_output

    fields = {**omni_fields(FAMILIES["sd"].call_kwargs), "num_inference_steps": 30}
    for together in (1, 2):  # alone, and two requests sharing one call: both aborted, the call stops at once
        reqs = [OmniDiffusionRequest(prompt=f"a cat {i}", sampling_params=SamplingParams(seed=i, **fields))
                for i in range(together)]
        aborted_at: list[int] = []
        lock = threading.Lock()

        def on_step(rid: str, step: int, total: int) -> None:
            with lock:
                if step >= 2 and not aborted_at:
                    aborted_at.append(step)
                    sd_engine.engine.abort([r.request_id for r in reqs])

        outs = [final_output(s) for s in sd_engine.engine.submit(reqs, on_progress=on_step)]
        assert [o.status for o in outs] == ["aborted"] * together
        assert max(o.metrics["steps_run"] for o in outs) <= aborted_at[0] + 1 < 30
    assert sd_engine.stats()["tracked_requests"] == []


def test_call_parameters_reach_the_call_and_equal_diffusers(sd_engine, family):
    fam = FAMILIES["sd"]
    fields = omni_fields(fam.call_kwargs)
    (plain,) = sd_engine.generate("a cat", seed=5, output_type="pt", use_tqdm=False, **fields)
    (rescaled,) = sd_engine.generate("a cat", seed=5, output_type="pt", use_tqdm=False,
                                     extra_args={"guidance_rescale": 0.7, "eta": 0.5}, **fields)
    ref = reference_call(reference(family("sd")), fam, ["a cat"], [5], guidance_rescale=0.7, eta=0.5)
    assert torch.equal(rescaled.images[0], ref[0]) and not torch.equal(rescaled.images[0], plain.images[0])


@pytest.mark.parametrize("extra, words", [
    ({"bogus": 1}, ["'bogus'", "not a parameter of the call", "guidance_rescale", "eta"]),
    ({"latents": None}, ["'latents'", "Omni sets it"]),
    ({"prompt_embeds": None}, ["'prompt_embeds'", "not a scalar parameter"]),
    ({"guidance_rescale": "high"}, ["'guidance_rescale'", "must be float or null", "str 'high'"]),
    ({"clip_skip": 1.5}, ["'clip_skip'", "must be int"]),
])
def test_bad_call_parameters_are_refused_before_any_work(sd_engine, extra, words):
    from omni_core.errors import ConfigError

    added = sd_engine.stats()["requests_added"]
    with pytest.raises(ConfigError) as err:
        sd_engine.generate("a cat", use_tqdm=False, extra_args=extra, **omni_fields(FAMILIES["sd"].call_kwargs))
    assert err.value.field == "extra_args"
    for word in words:
        assert word in str(err.value)
    assert sd_engine.stats()["requests_added"] == added


def test_core_fields_the_call_lacks_are_refused(family):
    """SD makes images (no num_frames), of sizes its VAE divides, from text alone (no image): each refused by name."""
    from omni_core import Omni
    from omni_core.errors import ConfigError

    with Omni(family("sd"), warmup=False, cpu_threads=1) as omni:
        with pytest.raises(ConfigError) as err:
            omni.generate("a cat", num_frames=5, use_tqdm=False)
        assert err.value.field == "num_frames"
        with pytest.raises(ConfigError) as err:
            omni.generate("a cat", height=33, width=32, use_tqdm=False)
        assert err.value.field == "height" and "multiple of" in str(err.value)
        with pytest.raises(ConfigError) as err:
            omni.generate({"prompt": "a cat", "image": example_image()}, use_tqdm=False)
        assert err.value.field == "image"


def _copy_with(src: str, dst: str, **index_changes) -> str:
    """A copy of ``src`` whose model_index.json has ``index_changes`` and whose weights are garbage: a loader that
    reads a weight fails with a safetensors error, not the refusal the test expects."""
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "model_index.json")) as f:
        index = json.load(f)
    index.update(index_changes)
    with open(os.path.join(dst, "model_index.json"), "w") as f:
        json.dump(index, f)
    for folder, _, files in os.walk(dst):
        for name in files:
            if name.endswith(".safetensors"):
                with open(os.path.join(folder, name), "wb") as f:
                    f.write(b"not weights")
    return dst


@pytest.mark.parametrize("changes, words", [
    ({"_class_name": "StableDiffusion9Pipeline"}, ["'StableDiffusion9Pipeline'", "does not have", "pip install -U diffusers"]),
    ({"unet": ["my_remote_code", "MyUNet"]}, ["'unet'", "'my_remote_code'", "no remote code"]),
    ({"unet": ["diffusers", "UNet9DConditionModel"]}, ["'unet'", "UNet9DConditionModel", "pip install -U diffusers"]),
    ({"custom_pipeline": "hub/some_pipeline"}, ["custom pipeline", "remote code is never run"]),
])
def test_folders_it_cannot_run_are_refused_before_any_weight_is_read(family, tmp_path, changes, words):
    from omni_core import Omni
    from omni_core.errors import ConfigError

    path = _copy_with(family("sd"), str(tmp_path / "bad"), **changes)
    with pytest.raises(ConfigError) as err:
        Omni(path, warmup=False)
    assert err.value.field == "model"
    for word in words:
        assert word in str(err.value)


def test_a_folder_no_plugin_claims_runs_here_and_pipeline_diffusers_forces_it(family):
    from omni_core.pipelines.loader import resolve_model
    from omni_core.plugins.manager import get_plugin_manager

    pipelines = get_plugin_manager().components("pipeline")
    for name, fam in FAMILIES.items():
        resolved = resolve_model(family(name))
        expected = fam.pipeline_class if fam.pipeline_class in pipelines else "diffusers"
        assert resolved.spec.name == expected  # a native plugin, when one is installed, serves its folders
        assert resolve_model(family(name), pipeline="diffusers").spec.name == "diffusers"

"""Request limits: safe defaults from the model, configurable per engine, checked before any work.

Every refusal must name the field, the requested value and the limit, and nothing may be queued or run.
"""

from __future__ import annotations

import time

import pytest

from omni_core.config import OmniDiffusionConfig, RequestLimits, SamplingParams
from omni_core.errors import ConfigError
from omni_core.pipelines import OmniPipeline
from omni_core.request import OmniDiffusionRequest


@pytest.fixture(scope="module")
def shapes():
    from omni_core import Omni

    with Omni("shapes", warmup=False) as omni:
        yield omni


def refused(omni, prompt="a red circle in the top left", **params):
    """The ConfigError of generating ``params``; asserts nothing was queued and it failed at once."""
    before = dict(omni.engine.counters)
    start = time.monotonic()
    with pytest.raises(ConfigError) as err:
        omni.generate(prompt, **params)
    assert time.monotonic() - start < 5, "the refusal must come before any work"
    assert omni.engine.counters == before, "a refused request must not reach the engine"
    return err.value


def test_shapes_defaults(shapes):
    """shapes is trained at 32x32: 64x64, 200 steps, 4 outputs, 4096 prompt characters, images only."""
    assert shapes.engine.limits == RequestLimits(max_pixels=4096, max_frames=1, max_steps=200, max_outputs=4,
                                                 max_prompt_chars=4096, max_image_pixels=4096 * 4096)


@pytest.mark.parametrize("params, field, text", [
    ({"height": 512, "width": 512}, "size",
     "height x width = 512x512 = 262144 pixels exceeds max_pixels=4096 for ShapesPipeline; raise it with "
     "limits={'max_pixels': ...} (omni serve --max-pixels)"),
    ({"height": 16384, "width": 16384}, "size", "268435456 pixels exceeds max_pixels=4096"),
    ({"height": 68, "width": 64}, "size", "4352 pixels exceeds max_pixels=4096"),
    ({"num_inference_steps": 1000}, "num_inference_steps",
     "num_inference_steps=1000 exceeds max_steps=200 for ShapesPipeline; raise it with limits={'max_steps': ...} "
     "(omni serve --max-steps)"),
    ({"num_inference_steps": 201}, "num_inference_steps", "num_inference_steps=201 exceeds max_steps=200"),
    ({"num_outputs_per_prompt": 16}, "num_outputs_per_prompt",
     "num_outputs_per_prompt=16 exceeds max_outputs=4 for ShapesPipeline; raise it with limits={'max_outputs': ...} "
     "(omni serve --max-outputs)"),
])
def test_over_a_limit_is_refused_before_any_work(shapes, params, field, text):
    err = refused(shapes, **params)
    assert err.field == field and text in str(err)


def test_prompt_length(shapes):
    err = refused(shapes, prompt="a" * 4097)
    assert err.field == "prompt"
    assert "prompt of 4097 characters exceeds max_prompt_chars=4096 for ShapesPipeline" in str(err)
    assert "--max-prompt-chars" in str(err)
    err = refused(shapes, prompt={"prompt": "a red circle", "negative_prompt": "b" * 10_000_000})
    assert err.field == "negative_prompt" and "negative_prompt of 10000000 characters" in str(err)


@pytest.mark.parametrize("prompt", ["", "   ", {"prompt": "\t", "negative_prompt": "blurry"}])
def test_empty_prompt_is_refused_by_the_engine(shapes, prompt):
    err = refused(shapes, prompt=prompt)
    assert err.field == "prompt" and "prompt must not be empty or whitespace only" in str(err)
    # the server builds requests itself and relies on the engine's check: same error, nothing queued
    added = shapes.engine.counters["requests_added"]
    with pytest.raises(ConfigError, match="prompt must not be empty or whitespace only"):
        shapes.engine.submit([OmniDiffusionRequest(prompt=" ", sampling_params=SamplingParams())])
    assert shapes.engine.counters["requests_added"] == added


def test_the_largest_allowed_request_runs(shapes):
    (out,) = shapes.generate("a" * 4096, height=64, width=64, num_inference_steps=1, num_outputs_per_prompt=4,
                             seed=0, output_type="pt")
    assert out.status == "completed" and len(out.images) == 4 and tuple(out.images[0].shape) == (3, 64, 64)


def test_engine_limits_override_the_model_defaults():
    from omni_core import Omni

    with Omni("shapes", warmup=False, limits={"max_pixels": 128 * 128, "max_steps": 2}) as omni:
        limits = omni.engine.limits
        assert (limits.max_pixels, limits.max_steps, limits.max_outputs) == (16384, 2, 4)  # the rest: the model's
        ok = omni.engine.prepare_request(OmniDiffusionRequest(
            prompt="x", sampling_params=SamplingParams(height=128, width=128, num_inference_steps=2)))
        assert ok.sampling_params.height == 128
        err = refused(omni, num_inference_steps=3)
        assert err.field == "num_inference_steps" and "exceeds max_steps=2" in str(err)
        # the server's path (engine.submit) checks the same limits
        with pytest.raises(ConfigError, match="exceeds max_pixels=16384"):
            omni.engine.submit([OmniDiffusionRequest(prompt="x", sampling_params=SamplingParams(height=132,
                                                                                                width=128))])
        assert omni.engine.counters["requests_added"] == 0


@pytest.mark.parametrize("limits, field, text", [
    ({"max_stepz": 3}, "max_stepz", "RequestLimits got an unknown field 'max_stepz'; did you mean 'max_steps'?"),
    ({"max_steps": 0}, "max_steps", "RequestLimits.max_steps=0 is invalid: must be >= 1"),
    ({"max_steps": 1001}, "max_steps", "must be <= 1000"),
    ({"max_outputs": 17}, "max_outputs", "must be <= 16"),
    ({"max_pixels": "big"}, "max_pixels", "expected an integer or None, got str"),
    ("max_steps=3", "limits", "limits must be a dict such as {'max_steps': 200}"),
])
def test_bad_limits_name_the_field(limits, field, text):
    with pytest.raises(ConfigError) as err:
        OmniDiffusionConfig.from_kwargs(model="m", limits=limits)
    assert err.value.field == field and text in str(err.value)


def test_limits_coerce_from_a_dict():
    config = OmniDiffusionConfig.from_kwargs(model="m", limits={"max_steps": 50})
    assert config.limits == RequestLimits(max_steps=50)
    assert OmniDiffusionConfig(model="m").limits == RequestLimits()


def test_base_defaults_are_derived_from_the_model():
    class Image(OmniPipeline):
        default_height, default_width = 16, 24

    class Video(OmniPipeline):
        is_video = True
        default_height, default_width, default_num_frames = 48, 32, 81

    class Declared(Image):
        default_limits = {"max_steps": 20, "max_outputs": 1}

    assert Image.request_limits() == RequestLimits(max_pixels=4 * 16 * 24, max_frames=1, max_steps=200,
                                                   max_outputs=4, max_prompt_chars=4096, max_image_pixels=4096 * 4096)
    assert Video.request_limits().max_frames == 161  # twice the default clip, still 4k+1
    declared = Declared.request_limits({"max_outputs": 2})
    assert (declared.max_steps, declared.max_outputs, declared.max_pixels) == (20, 2, 1536)


def test_a_misspelt_default_limit_is_an_error():
    class Bad(OmniPipeline):
        default_limits = {"max_frame": 3}

    with pytest.raises(ConfigError, match="unknown field 'max_frame'; did you mean 'max_frames'"):
        Bad.request_limits()


def test_qwen_image_limits():
    qwen = pytest.importorskip("omni_model_qwen_image.pipeline")
    limits = qwen.QwenImagePipeline.request_limits()
    assert (limits.max_pixels, limits.max_frames, limits.max_steps) == (2048 * 2048, 1, 200)
    limits.check(SamplingParams(height=1328, width=1328, num_inference_steps=50))
    with pytest.raises(ConfigError, match="2560x2048 = 5242880 pixels exceeds max_pixels=4194304"):
        limits.check(SamplingParams(height=2560, width=2048), model="QwenImagePipeline")


def test_wan_limits():
    wan = pytest.importorskip("omni_model_wan.pipeline")
    limits = wan.WanPipeline.request_limits()
    assert (limits.max_pixels, limits.max_frames) == (1280 * 720, 121)
    limits.check(SamplingParams(height=720, width=1280, num_frames=121))
    with pytest.raises(ConfigError, match="num_frames=125 exceeds max_frames=121 for WanPipeline") as err:
        limits.check(SamplingParams(height=480, width=832, num_frames=125), model="WanPipeline")
    assert err.value.field == "num_frames"
    with pytest.raises(ConfigError, match="1088x1920 = 2088960 pixels exceeds max_pixels=921600"):
        limits.check(SamplingParams(height=1088, width=1920, num_frames=81))

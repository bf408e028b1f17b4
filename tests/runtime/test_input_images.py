"""Input images through the Python API: checked in the engine's process before any work (naming ``image``),
carried to the pipeline as uint8 tensors (also across processes), and part of batch compatibility where the
model declares it. Runs the test-only ``TinyEditTestPipeline`` (``omni-test-pipeline``)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from omni_core.errors import ConfigError

QUICK = {"num_inference_steps": 2, "seed": 7, "height": 16, "width": 16}


def picture(width: int = 24, height: int = 20, seed: int = 0, mode: str = "RGB"):
    from PIL import Image

    rng = np.random.default_rng(seed)
    image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
    return image.convert(mode) if mode != "RGB" else image



@pytest.fixture(scope="module")
def omni(edit_model):
    from omni_core import Omni

    with Omni(edit_model, max_num_seqs=4, limits={"max_image_pixels": 64 * 64}) as o:
        yield o


def pixels(out) -> np.ndarray:
    return np.asarray(out.images[0], dtype=np.int16)


def refused(omni, prompt) -> ConfigError:
    before = dict(omni.engine.counters)
    start = time.monotonic()
    with pytest.raises(ConfigError) as err:
        omni.generate(prompt, **QUICK)
    assert time.monotonic() - start < 5 and omni.engine.counters == before, "refused before reaching the engine"
    return err.value


def test_the_image_changes_the_output_and_both_spellings_agree(omni):
    (a,) = omni.generate({"prompt": "make it red", "image": picture(seed=1)}, **QUICK)
    (b,) = omni.generate({"prompt": "make it red", "image": picture(seed=2)}, **QUICK)
    (c,) = omni.generate({"prompt": "make it red", "multi_modal_data": {"image": [picture(seed=1)]}}, **QUICK)
    assert a.status == b.status == c.status == "completed"
    assert np.abs(pixels(a) - pixels(b)).max() > 10, "a different input image must change the edit"
    assert np.array_equal(pixels(a), pixels(c)), "image= and multi_modal_data={'image': [...]} are the same input"


def test_modes_convert_to_rgb_as_diffusers_does(omni):
    rgba = picture(seed=3, mode="RGBA")
    (a,) = omni.generate({"prompt": "x", "image": rgba}, **QUICK)
    (b,) = omni.generate({"prompt": "x", "image": rgba.convert("RGB")}, **QUICK)
    assert np.array_equal(pixels(a), pixels(b))


@pytest.mark.parametrize("prompt, words", [
    ({"prompt": "x"}, "TinyEditTestPipeline needs the image to edit: give 'image' with 1 to 2 images (got 0)"),
    ({"prompt": "x", "image": [picture(), picture(), picture()]}, "takes at most 2 input images, got 3"),
    ({"prompt": "x", "image": "photo.png"}, "image must be a PIL image (PIL.Image.Image), got str"),
    ({"prompt": "x", "image": picture(100, 100)}, "image is 100x100 = 10000 pixels, which exceeds max_image_pixels=4096"),
    ({"prompt": "x", "image": picture(mode="I;16")}, "image has mode 'I;16'"),
    ({"prompt": "x", "image": picture(), "multi_modal_data": {"image": picture()}}, "give the input images once"),
    ({"prompt": "x", "multi_modal_data": {"audio": b""}}, "multi_modal_data must be a dict with 'image'"),
    ({"prompt": "x", "images": picture()}, "unknown keys ['images']"),
], ids=["none", "too-many", "not-an-image", "too-large", "16-bit", "twice", "audio", "misspelt"])
def test_bad_images_are_refused_naming_the_field(omni, prompt, words):
    err = refused(omni, prompt)
    assert words in str(err)
    assert err.field in ("image", "prompt", "multi_modal_data")


def test_a_text_model_refuses_images(tiny_model):
    from omni_core import Omni

    with Omni(tiny_model, warmup=False) as omni:
        err = refused(omni, {"prompt": "x", "image": picture()})
    assert err.field == "image" and "TinyTestPipeline does not take input images" in str(err)


@pytest.mark.parametrize("images", [
    [picture(24, 20), picture(24, 20, seed=5), picture(32, 16)],
    [[picture(24, 20), picture(24, 20, seed=1)], [picture(24, 20, seed=5), picture(24, 20, seed=6)],
     [picture(24, 20, seed=7), picture(32, 16)]],  # the third differs in its second image only
], ids=["one-image", "second-image-differs"])
def test_input_sizes_split_waves_when_the_model_declares_it(edit_model, images):
    """Two requests with same-size inputs share each wave; a third with another input size runs in its own."""
    from omni_core import Omni

    # one CPU thread: no lanes, so denoise_log sees whole waves
    with Omni(edit_model, max_num_seqs=4, step_execution=True, warmup=False, cpu_threads=1) as omni:
        pipe = omni.engine.executor.runner.pipeline
        pipe.denoise_log.clear()
        prompts = [{"prompt": f"p{i}", "image": image} for i, image in enumerate(images)]
        outs = omni.generate(prompts, **QUICK)
        assert [o.status for o in outs] == ["completed"] * 3
        waves = [sorted(rid for rid, _ in wave) for wave in pipe.denoise_log]
    ids = [o.request_id for o in outs]
    assert sorted(ids[:2]) in waves and [ids[2]] in waves
    assert not any(ids[2] in wave and len(wave) > 1 for wave in waves)


def test_images_cross_to_worker_processes_as_tensors(edit_model, omni):
    """The mp executor gives the same pixels as the in-process one: the images reach the worker intact."""
    from omni_core import Omni

    prompt = {"prompt": "edit", "image": [picture(seed=9), picture(30, 18, seed=10)]}
    (ref,) = omni.generate(prompt, **QUICK)
    with Omni(edit_model, executor="mp", warmup=False) as mp:
        (out,) = mp.generate(prompt, **QUICK)
    assert np.array_equal(pixels(ref), pixels(out))


def test_the_request_carries_uint8_tensors_after_the_check(omni):
    import torch

    from omni_core.config import SamplingParams
    from omni_core.request import OmniDiffusionRequest

    request = OmniDiffusionRequest(prompt="x", sampling_params=SamplingParams.from_kwargs(**QUICK),
                                   images=[picture(24, 20)])
    request = omni.engine.prepare_request(request)
    (tensor,) = request.images
    assert isinstance(tensor, torch.Tensor) and tensor.dtype == torch.uint8 and tuple(tensor.shape) == (3, 20, 24)
    assert request.batch_extra == (1, (20, 24))

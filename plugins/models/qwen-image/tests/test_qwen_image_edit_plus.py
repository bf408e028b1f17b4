"""Omni's QwenImageEditPlusPipeline (1-3 input images) against diffusers' own on one tiny random folder.

Two input images of different sizes: each seen by the VL encoder at ~384x384 and by the VAE at ~1 MP, so
the image stream of a row is the noisy latents then both images' latents (4 + 1036 + 1036 tokens here).
Parity as for the one-image edit pipeline: <= 1 level of 255, final latents within 5e-5.
"""

from __future__ import annotations

import pytest
import torch

from omni_core.config import SamplingParams
from omni_core.errors import ConfigError
from omni_core.pipelines import StepState, resolve_model
from omni_core.request import OmniDiffusionRequest

STEPS = 3
SIZE = 64
CFG = 4.0
CASES = [("put the cat from picture 2 into picture 1", 5, "blurry"), ("make both red", 6, None)]

_REFERENCES: dict = {}


@pytest.fixture(scope="module")
def images(edit_image):
    from PIL import ImageOps

    return [edit_image, ImageOps.flip(edit_image).resize((40, 56))]


def reference(pipe, images, prompt, seed, negative):
    key = (prompt, seed, negative)
    if key not in _REFERENCES:
        final = {}

        def keep(_pipe, _i, _t, kwargs):
            final["latents"] = kwargs["latents"]
            return kwargs

        out = pipe(image=list(images), prompt=prompt, negative_prompt=negative, true_cfg_scale=CFG, height=SIZE,
                   width=SIZE, num_inference_steps=STEPS, output_type="pt",
                   generator=torch.Generator("cpu").manual_seed(seed), callback_on_step_end=keep).images
        _REFERENCES[key] = (out, final["latents"])
    return _REFERENCES[key]


def make_state(model_dir, images, prompt, seed, negative=None):
    from omni_core.images import to_tensor
    from omni_model_qwen_image.edit import QwenImageEditPlusPipeline

    params = QwenImageEditPlusPipeline.check_sampling_params(
        SamplingParams(height=SIZE, width=SIZE, num_inference_steps=STEPS, true_cfg_scale=CFG, seed=seed), model_dir)
    request = OmniDiffusionRequest(prompt=prompt, negative_prompt=negative, sampling_params=params)
    request.images = [to_tensor(im) for im in images]
    return StepState(request=request, generator=torch.Generator("cpu").manual_seed(seed))


def assert_parity(state, output, ref):
    ref_images, ref_latents = ref
    assert output.tensor.shape == ref_images.shape
    assert ((output.tensor * 255).round() - (ref_images * 255).round()).abs().max().item() <= 1
    torch.testing.assert_close(state.latents, ref_latents, atol=5e-5, rtol=0)


def test_registered_through_entry_point(plus_dir):
    from omni_core.plugins.manager import get_plugin_manager

    assert get_plugin_manager().get_component("pipeline", "QwenImageEditPlusPipeline").provider == "omni-model-qwen-image"
    assert resolve_model(plus_dir).spec.name == "QwenImageEditPlusPipeline"


def test_two_images_request_batch_is_one_call_per_step_and_matches_diffusers(plus_dir, images, omni_plus,
                                                                            diffusers_plus):
    states = [make_state(plus_dir, images, *c) for c in CASES]
    calls = []
    hook = omni_plus.transformer.register_forward_pre_hook(
        lambda mod, args, kwargs: calls.append((tuple(kwargs["hidden_states"].shape[:2]), kwargs["img_shapes"][0])),
        with_kwargs=True)
    try:
        outs = omni_plus.forward(states)
    finally:
        hook.remove()
    # 64x48 -> 1184x896 (37x28 tokens); 40x56 -> 864x1216 (27x38 tokens); both after the 2x2 noisy tokens
    assert calls == [((3, 4 + 37 * 28 + 27 * 38), [(1, 2, 2), (1, 28, 37), (1, 38, 27)])] * STEPS
    for state, out, case in zip(states, outs, CASES):
        assert_parity(state, out, reference(diffusers_plus, images, *case))


def test_step_batch_requests_admitted_at_different_steps(plus_dir, images, omni_plus, diffusers_plus):
    from omni_core.testing.driver import run_step_batch

    states = [make_state(plus_dir, images, *c) for c in CASES]
    outs = run_step_batch(omni_plus, states, admit_at=[0, 1])
    for state, out, case in zip(states, outs, CASES):
        assert_parity(state, out, reference(diffusers_plus, images, *case))


@pytest.mark.parametrize("count, match", [(0, r"needs the images to edit: give 'image' with 1 to 3 images \(got 0\)"),
                                          (4, "takes at most 3 input images, got 4")])
def test_image_count_is_checked_in_the_engine(plus_dir, edit_image, count, match):
    from omni_model_qwen_image.edit import QwenImageEditPlusPipeline

    req = OmniDiffusionRequest(prompt="x", sampling_params=SamplingParams(), images=[edit_image] * count)
    with pytest.raises(ConfigError, match=match) as err:
        QwenImageEditPlusPipeline.check_images(req, QwenImageEditPlusPipeline.request_limits())
    assert err.value.field == "image"

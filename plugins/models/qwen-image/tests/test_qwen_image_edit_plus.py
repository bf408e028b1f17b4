"""Omni's QwenImageEditPlusPipeline (1-3 input images) against diffusers' own on one tiny random folder.

Two input images of different sizes: each seen by the VL encoder at ~384x384 and by the VAE at ~1 MP, so
the image stream of a row is the noisy latents then both images' latents (4 + 1036 + 1036 tokens here).
``TestQwenImageEditPlusParity`` is the core's :class:`~omni_core.testing.DiffusersParityContract` with both
images in every request (request and step mode, CFG on and off, staggered admission, one call per wave equal to
each request alone). Parity as for the one-image edit pipeline: <= 1 level of 255, final latents within 5e-5.
"""

from __future__ import annotations

import pytest

from omni_core.config import SamplingParams
from omni_core.errors import ConfigError
from omni_core.request import OmniDiffusionRequest
from omni_core.testing import DiffusersParityContract

STEPS = 3


class TestQwenImageEditPlusParity(DiffusersParityContract):
    tiny_model = "plus"
    sampling = {"num_inference_steps": STEPS, "height": 64, "width": 64}
    prompts = ("put the cat from picture 2 into picture 1", "make both red", "swap the two pictures' colours")
    negative_prompt = "blurry"
    cfg_field, cfg_scale, cfg_off, cfg_needs_negative = "true_cfg_scale", 4.0, 1.0, True
    seeds = (5, 6, 7)
    images_per_request = 2
    alone_folds_branches = False
    #: diffusers' run costs ~2 s here (its VAE encodes two ~1 MP images): two requests, CFG on and off, serve
    #: every check
    request_batch, cfg_modes = 2, ("mixed",)

    #: the parity tolerance's teeth on the edit path are checked by ``TestQwenImageEditParity`` (same model code,
    #: one image); here each wrong run costs two ~1 MP VAE encodes
    test_parity_check_has_teeth = None
    #: the engine with input images end to end: ``TestQwenImageEditParity`` (the same engine path)
    test_engine_matches_diffusers = None

    def staggered_cases(self):
        return self.request_cases("mixed")

    def batch_cases(self):
        return [*self.request_cases("mixed"), self.case(2, 7, negative="ugly")]

    @pytest.fixture(autouse=True)
    def _images(self, edit_image):
        from PIL import ImageOps

        self.images = [edit_image, ImageOps.flip(edit_image).resize((40, 56))]

    def input_images(self):
        return self.images

    def test_two_images_are_one_image_stream_per_row(self):
        """64x48 -> 1184x896 (37x28 tokens); 40x56 -> 864x1216 (27x38 tokens); both after the 2x2 noisy tokens,
        in one call per step."""
        cases = self.request_cases("mixed")
        states = [self.make_state(c) for c in cases]
        calls = []
        hook = self.omni.transformer.register_forward_pre_hook(
            lambda mod, args, kwargs: calls.append((tuple(kwargs["hidden_states"].shape[:2]), kwargs["img_shapes"][0])),
            with_kwargs=True)
        try:
            outs = self.omni.forward(states)
        finally:
            hook.remove()
        assert calls == [((3, 4 + 37 * 28 + 27 * 38), [(1, 2, 2), (1, 28, 37), (1, 38, 27)])] * STEPS
        for state, out, case in zip(states, outs, cases):
            self.assert_parity(state, out, case)


@pytest.mark.parametrize("count, match", [(0, r"needs the images to edit: give 'image' with 1 to 3 images \(got 0\)"),
                                          (4, "takes at most 3 input images, got 4")])
def test_image_count_is_checked_in_the_engine(plus_dir, edit_image, count, match):
    from omni_model_qwen_image.edit import QwenImageEditPlusPipeline

    req = OmniDiffusionRequest(prompt="x", sampling_params=SamplingParams(), images=[edit_image] * count)
    with pytest.raises(ConfigError, match=match) as err:
        QwenImageEditPlusPipeline.check_images(req, QwenImageEditPlusPipeline.request_limits())
    assert err.value.field == "image"

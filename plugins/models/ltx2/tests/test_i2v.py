"""Image-to-video parity with diffusers' ``LTX2ImageToVideoPipeline``, video and audio: the contract's checks
(one image per request, images of different sizes in one batch, staggered step mode, a wave equal to each
request alone, ``Omni(...)`` end to end) with the harness of ``test_ltx2``; the image's H.264 re-compression
(``image_crf``) and its first-frame conditioning have teeth."""

from __future__ import annotations

import pytest
from PIL import Image

from omni_model_ltx2.parity import LTX2Parity

#: three input images of different sizes and colours (each resized to the output size by diffusers' processor)
IMAGES = [Image.new("RGB", (40, 24), (200, 40, 40)), Image.new("RGB", (32, 32), (30, 160, 60)),
          Image.radial_gradient("L").convert("RGB").resize((48, 40))]


class TestLTX2I2VParity(LTX2Parity):
    tiny_model = "i2v"
    images_per_request = 1
    other_size = {"width": 64}
    cfg_modes = ("off", "on")
    engine_modes = ("step-batch",)
    engine_requests = 2

    def input_images(self):
        return IMAGES

    def case(self, i, seed, *, images=None, **fields):
        """Prompt ``i`` with image ``i``."""
        return super().case(i, seed, images=(i % len(IMAGES),) if images is None else images, **fields)

    @pytest.mark.parametrize("wrong", ["image", "crf"])
    def test_image_and_crf_have_teeth(self, wrong):
        """Another image, or no re-compression, moves the output far outside the tolerance."""
        case = self.case(0, 3)
        bad = {**case, "images": (1,)} if wrong == "image" else {**case, "image_crf": 0}
        state = self.make_state(bad)
        (out,) = self.omni.forward([state])
        with pytest.raises(AssertionError):
            self.assert_parity(state, out, case)

"""Omni's HunyuanVideo15ImageToVideoPipeline against diffusers' own on the tiny image-to-video folder (SigLIP image
tower, float32, CPU): the parity contract's request batch (CFG on and mixed), staggered step mode, one call per wave,
and the check's teeth, each request with its own image (images of two aspect ratios: two
latent sizes in one wave); plus MeanFlow's ``timestep_r`` and an image's reach (another image moves the video)."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from omni_core.testing import levels_apart
from omni_model_hunyuan_video15.parity import HunyuanParity


def _image(seed: int, size: tuple[int, int]) -> Image.Image:
    g = torch.Generator().manual_seed(seed)
    pixels = (torch.rand(size[1], size[0], 3, generator=g) * 255).to(torch.uint8).numpy()
    return Image.fromarray(pixels)


#: three square images of different sizes (one 32x32 bucket: the contract's waves have one latent size) and a wide one
IMAGES = [_image(0, (40, 40)), _image(1, (36, 36)), _image(2, (44, 44)), _image(3, (48, 32))]


class TestHunyuanVideo15I2VParity(HunyuanParity):
    tiny_model = "hvi2v"
    images_per_request = 1
    other_size: dict = {}  # the size comes from the image
    cfg_modes = ("on", "mixed")
    #: the engine path is text-to-video's (test_parity.py runs it end to end in both modes)
    engine_modes = ()

    def input_images(self):
        return IMAGES

    def case(self, i, seed, *, images=None, **kw):
        return super().case(i, seed, images=(i % 3,) if images is None else images, **kw)

    def reference_kwargs(self, case):
        kwargs = super().reference_kwargs(case)
        kwargs.pop("height", None), kwargs.pop("width", None)  # diffusers' I2V takes its size from the image
        return kwargs

    def test_two_image_sizes_in_one_wave_and_another_image_moves_the_video(self):
        cases = [self.case(0, 3), self.case(1, 4, images=(3,))]
        states = [self.make_state(c) for c in cases]
        outs = self.omni.forward(states)
        assert states[0].latents.shape != states[1].latents.shape  # 40x40 -> the 32x32 bucket, 48x32 -> a wide one
        for case, state, out in zip(cases, states, outs):
            self.assert_parity(state, out, case)
        other = self.make_state(self.case(0, 3, images=(1,)))
        (moved,) = self.omni.forward([other])
        assert levels_apart(moved.tensor, outs[0].tensor) > 1

    def test_meanflow_passes_the_next_timestep(self, monkeypatch):
        """MeanFlow folders (``use_meanflow``): ``timestep_r`` is each row's next timestep, 0 at the last step."""
        state = self.make_state(self.case(0, 3, cfg=False))
        self.omni.prepare_encode(state)
        assert self.omni.extra_inputs([(state, "cond")]) == {}
        monkeypatch.setattr(self.omni, "use_meanflow", True)
        got = []
        for i in range(state.num_steps):
            state.step_index = i
            got.append(float(self.omni.extra_inputs([(state, "cond")])["timestep_r"][0]))
        assert got == [float(t) for t in state.timesteps[1:]] + [0.0]

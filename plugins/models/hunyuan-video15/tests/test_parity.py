"""Omni's HunyuanVideo15Pipeline against diffusers' own on the tiny text-to-video folder (float32, CPU).

``TestHunyuanVideo15Parity`` is the core's :class:`~omni_core.testing.DiffusersParityContract` (request and step
mode, CFG off / on / mixed, three prompts of different lengths in one batch, staggered admission with another size,
one call per wave equal to each request alone, the engine end to end, the check's teeth) plus HunyuanVideo 1.5's
own: ByT5 glyph text ("quoted" words) next to prompts without, a non-square size, and diffusers' full padding.
Parity: at most one level of 255 per value, final latents within 5e-5.
"""

from __future__ import annotations

import torch

from omni_model_hunyuan_video15.parity import HunyuanParity, diffusers_reference
from omni_core.testing import levels_apart


class TestHunyuanVideo15Parity(HunyuanParity):
    tiny_model = "hv"

    def test_glyph_text_and_non_square_match_diffusers(self):
        """A prompt with quoted glyph text (ByT5 tokens) in one wave with prompts without any, at 16x24."""
        cases = [self.case(0, 7, height=24, width=16),
                 self.case(1, 8, cfg=False, height=24, width=16)]
        cases[0]["prompt"] = 'a neon sign that reads "OPEN" at night'
        states = [self.make_state(c) for c in cases]
        outs = self.omni.forward(states)
        assert states[0].extra["byt5"].shape[1] > 0 and states[1].extra["byt5"].shape[1] == 0
        for case, state, out in zip(cases, states, outs):
            self.assert_parity(state, out, case)

    def test_full_padding_equals_short_padding(self):
        """diffusers at its own padding (1000 Qwen tokens, 256 ByT5, 729 image tokens, all masked) gives what the
        shorter-padded references give, and what Omni's unpadded text gives."""
        from diffusers import DiffusionPipeline

        full = DiffusionPipeline.from_pretrained(self.model_path, use_safetensors=True)
        full.set_progress_bar_config(disable=True)
        case = self.case(0, self.seeds[0])
        ref, ref_latents = self.reference(case)
        video, latents = diffusers_reference(full, case["prompt"], case["negative_prompt"], case["seed"],
                                             case["guidance_scale"], **self.sampling)
        assert levels_apart(video, ref) <= 1
        torch.testing.assert_close(latents, ref_latents, atol=5e-5, rtol=0)

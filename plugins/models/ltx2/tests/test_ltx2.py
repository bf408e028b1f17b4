"""Parity with diffusers' ``LTX2Pipeline`` on the tiny folder, video AND audio.

``TestLTX2Parity`` is the core's :class:`~omni_core.testing.DiffusersParityContract` (request and step mode, CFG
off / on / mixed, three prompts of different lengths in one batch, staggered admission at another size, two
outputs at a non-square size, one call per wave equal to each request alone, ``Omni(...)`` end to end), with
every check also holding the waveform to diffusers' (``audio`` within one level of 255 over its [-1, 1] range)
and the final packed video latents to ``latents_atol``. The contract's cases run with STG and modality guidance
off (its wave check counts conditional and unconditional rows only) and an audio CFG scale of their own; LTX-2's
own test below runs diffusers' defaults (CFG 3 / audio 7, STG at a block that exists, modality 3, rescale 0.7)
in one wave.
"""

from __future__ import annotations

import pytest

from omni_model_ltx2.parity import LTX2Parity

class TestLTX2Parity(LTX2Parity):
    tiny_model = "ltx2"
    other_size = {"width": 64}
    non_square = {"height": 32, "width": 64}
    engine_requests = 2

    def test_default_guidance_stg_modality_rescale_in_one_wave(self):
        """diffusers' default guidance (CFG 3 / audio 7, STG 1 at block 1 of the 2, modality 3, rescale 0.7) for
        two requests in one wave, each equal to diffusers alone; one transformer call per step holding each
        request's cond, uncond, STG and modality rows."""
        defaults = {"stg_scale": None, "audio_stg_scale": None, "modality_scale": None, "audio_modality_scale": None,
                    "guidance_scale": 3.0, "audio_guidance_scale": None, "stg_block": 1}
        cases = [{**self.case(0, 5, negative=None), **defaults}, {**self.case(2, 6), **defaults}]
        cases = [{k: v for k, v in c.items() if v is not None or k == "negative_prompt"} for c in cases]
        states = [self.make_state(c) for c in cases]
        with self.denoiser_calls() as calls:
            outs = self.omni.forward(states)
        assert [rows for _, _, rows in calls] == [8] * 3, "one call per step with 4 rows per request"
        for s, o, c in zip(states, outs, cases):
            self.assert_parity(s, o, c)

    def test_audio_check_has_teeth(self):
        """Another seed moves the waveform far outside ``audio_atol`` (the video is left as diffusers' own)."""
        case = self.case(1, self.seeds[1])
        other = self.reference_audio({**case, "seed": case["seed"] + 1})
        assert (other - self.reference_audio(case)).abs().max() > 100 * self.audio_atol

    @pytest.mark.parametrize("knob", ["audio_guidance_scale", "stg_scale", "modality_scale", "audio_guidance_rescale"])
    def test_audio_and_guidance_knobs_have_teeth(self, knob):
        """Each knob moves the output far outside the parity tolerance (so the parity above checks it)."""
        base = {**self.case(1, 7), "stg_block": 1, "stg_scale": 1.0, "audio_stg_scale": 1.0, "modality_scale": 3.0,
                "audio_modality_scale": 3.0, "audio_guidance_rescale": 0.7}
        wrong = {**base, knob: base[knob] + (0.3 if knob.endswith("rescale") else 2.0)}
        state = self.make_state(wrong)
        (out,) = self.omni.forward([state])
        with pytest.raises(AssertionError):
            self.assert_parity(state, out, base)

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
import torch

from omni_core.testing import DiffusersParityContract, levels_apart

SAMPLING = {"num_inference_steps": 3, "height": 32, "width": 32, "num_frames": 9, "frame_rate": 25.0,
            "max_sequence_length": 64, "stg_scale": 0.0, "audio_stg_scale": 0.0, "modality_scale": 1.0,
            "audio_modality_scale": 1.0}
#: diffusers' waveforms of the session, by the contract's reference key
_AUDIO: dict = {}


def audio_levels(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference of two waveforms in [-1, 1], in levels of 255 over that range."""
    return levels_apart((a.float() + 1) / 2, (b.float() + 1) / 2)


class LTX2Parity(DiffusersParityContract):
    """The contract's harness with the audio track compared too."""

    tiny_model = "ltx2"
    sampling = SAMPLING
    cfg_field, cfg_scale, cfg_off = "guidance_scale", 4.0, 1.0
    outputs_kwarg = "num_videos_per_prompt"

    def case(self, i, seed, *, cfg=True, **kwargs):
        """The contract's case with the audio stream guided at its own scale (1 more than the video's) when the
        video is, and off when it is off (diffusers guides both when either scale is above 1)."""
        case = super().case(i, seed, cfg=cfg, **kwargs)
        g = case["guidance_scale"]
        case.setdefault("audio_guidance_scale", g + 1.0 if g > 1.0 else 1.0)
        return case

    def reference(self, case):
        key = (id(self.diffusers), tuple(sorted(case.items())))
        if key not in _AUDIO:
            prompt, seed, negative, _, _ = self._split(case)
            final: dict = {}

            def keep(_pipe, _i, _t, kwargs):
                final["latents"] = kwargs["latents"]
                return kwargs

            out = self.diffusers(prompt=prompt, negative_prompt=negative, output_type="pt",
                                 generator=torch.Generator("cpu").manual_seed(seed), callback_on_step_end=keep,
                                 **self.reference_kwargs(case))
            _AUDIO[key] = (out.frames, final["latents"], out.audio)
        return _AUDIO[key][:2]

    def reference_audio(self, case):
        self.reference(case)
        return _AUDIO[(id(self.diffusers), tuple(sorted(case.items())))][2]

    def compare_latents(self, latents, ref_latents):
        """The joined state's video part against diffusers' packed video latents."""
        n, s, c = ref_latents.shape
        torch.testing.assert_close(latents[:, :s * c].unflatten(1, (s, c)), ref_latents, atol=self.latents_atol,
                                   rtol=0)

    def assert_parity(self, state, output, case):
        super().assert_parity(state, output, case)
        ref = self.reference_audio(case)
        assert output.audio is not None and output.audio.shape == ref.shape, \
            f"audio {None if output.audio is None else tuple(output.audio.shape)}, diffusers {tuple(ref.shape)}"
        assert output.audio_sample_rate == self.diffusers.vocoder.config.output_sampling_rate
        diff = audio_levels(output.audio, ref)
        assert diff <= self.levels, f"audio {diff} levels of 255 apart from diffusers ({case['prompt']!r})"


class TestLTX2Parity(LTX2Parity):
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

    def reference_kwargs(self, case):
        kwargs = super().reference_kwargs(case)
        if "stg_block" in kwargs:
            kwargs["spatio_temporal_guidance_blocks"] = [kwargs.pop("stg_block")]
        return kwargs

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

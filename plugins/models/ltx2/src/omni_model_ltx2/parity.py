"""The parity harness of this plugin's tests: the core's :class:`~omni_core.testing.DiffusersParityContract` with
LTX-2's audio track compared too (diffusers' waveform memoised with its frames; ``audio`` within one level of 255
over its [-1, 1] range and within ``audio_atol``; the joined state's video part against diffusers' packed latents). Imports pytest (through
``omni_core.testing``): for tests only.
"""

from __future__ import annotations

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

    sampling = SAMPLING
    cfg_field, cfg_scale, cfg_off = "guidance_scale", 4.0, 1.0
    outputs_kwarg = "num_videos_per_prompt"
    #: the waveform against diffusers' (measured: <= 3e-8; another seed moves it by ~1e-3)
    audio_atol = 1e-5

    def case(self, i, seed, *, cfg=True, **kwargs):
        """The contract's case with the audio stream guided at its own scale (1 more than the video's) when the
        video is, and off when it is off (diffusers guides both when either scale is above 1)."""
        case = super().case(i, seed, cfg=cfg, **kwargs)
        g = case["guidance_scale"]
        case.setdefault("audio_guidance_scale", g + 1.0 if g > 1.0 else 1.0)
        return case

    def reference_kwargs(self, case):
        """diffusers' keywords: ``stg_block`` is its ``spatio_temporal_guidance_blocks=[block]``."""
        kwargs = super().reference_kwargs(case)
        if "stg_block" in kwargs:
            kwargs["spatio_temporal_guidance_blocks"] = [kwargs.pop("stg_block")]
        return kwargs

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
        # the tiny folder's waveform moves little with its latents (another seed: ~1e-3), so it is held tighter
        # than one level of 255 too
        torch.testing.assert_close(output.audio, ref, atol=self.audio_atol, rtol=0)

"""This plugin against diffusers' own ``PixArtSigmaPipeline`` on the tiny folder (float32, CPU).

* A request alone, through ``Omni(folder)`` in request mode and in step mode, equals diffusers' call with the same
  seed **bit for bit** (images and final latents): one transformer call per step of the same rows, the
  same masked text, the same DPM-Solver steps.
* ``TestPixArtParity`` is the core's ``DiffusersParityContract``: three prompts of different lengths in one
  request batch (CFG off, on, mixed), staggered step-mode admission at another size, several outputs at a
  non-square size, a wave of four requests as one call per step, the engine end to end. Batched rows are held
  to one level of 255 and final latents within 1e-4: batching changes only float summation order (see
  ``latents_atol``).

diffusers is called with ``use_resolution_binning=False`` (Omni makes the size asked for; binning would also
refuse the tiny folder's sample size) and ``clean_caption=False`` (what diffusers does anyway without ``bs4`` and
``ftfy``).
"""

from __future__ import annotations

import pytest
import torch

from omni_core import Omni
from omni_core.testing import DiffusersParityContract, levels_apart

SAMPLING = {"num_inference_steps": 3, "height": 16, "width": 16, "max_sequence_length": 64}
DIFFUSERS_ONLY = {"use_resolution_binning": False, "clean_caption": False}
#: diffusers' outputs of the session, by case (one folder, one diffusers pipeline per session)
_DIFFUSERS: dict = {}


def diffusers_call(pipe, prompt: str, seed: int, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers' output (``output_type="pt"``) and final latents. PixArt's ``__call__`` still takes the old
    ``callback(step, t, latents)``, not ``callback_on_step_end``."""
    final = {}
    out = pipe(prompt=prompt, output_type="pt", generator=torch.Generator("cpu").manual_seed(seed),
               callback=lambda i, t, latents: final.update(latents=latents), **DIFFUSERS_ONLY, **kwargs)
    return out[0], final["latents"]


class TestPixArtParity(DiffusersParityContract):
    tiny_model = "pixart"
    sampling = SAMPLING
    cfg_field, cfg_scale, cfg_off = "guidance_scale", 4.5, 1.0
    other_size = {"width": 24}  # joins a step wave of 16x16 requests
    non_square = {"height": 24, "width": 16}
    #: batched rows differ from a row alone by float summation order (~1e-7), and DPM-Solver++ divides its first
    #: noise prediction by alpha ~0.006 to get the clean estimate: final latents differ by up to 2.2e-5 (measured;
    #: images by 1.6e-6, at most one level of 255). A request alone is held to 0 (the bit-for-bit tests below)
    latents_atol = batch_latents_atol = 1e-4

    def reference(self, case):
        """diffusers' run of ``case`` (memoised), as the contract's, but through PixArt's old-style callback; no
        negative prompt is diffusers' default ``""`` (its call refuses None), as in Omni."""
        key = tuple(sorted(case.items()))
        if key not in _DIFFUSERS:
            prompt, seed, negative, _, _ = self._split(case)
            _DIFFUSERS[key] = diffusers_call(self.diffusers, prompt, seed, negative_prompt=negative or "",
                                             **self.reference_kwargs(case))
        return _DIFFUSERS[key]

    @pytest.mark.parametrize("step_execution", [False, True], ids=["request-mode", "step-mode"])
    def test_a_request_alone_is_diffusers_bit_for_bit(self, step_execution):
        """``Omni(folder)`` end to end, images and final latents (``output_type="latent"``): with CFG and a
        negative prompt, and two outputs without CFG."""
        requests = [("a red fox jumping over a lazy dog", "blurry", 4.5, 1), ("a cat", None, 1.0, 2)]
        with Omni(self.model_path, dtype="float32", warmup=False, cpu_threads=1, max_num_seqs=1,
                  step_execution=step_execution) as omni:
            for seed, (prompt, negative, scale, n) in enumerate(requests):
                (out,) = omni.generate({"prompt": prompt, "negative_prompt": negative}, seed=seed, output_type="pt",
                                       guidance_scale=scale, num_outputs_per_prompt=n, use_tqdm=False, **SAMPLING)
                (latents,) = omni.generate({"prompt": prompt, "negative_prompt": negative}, seed=seed,
                                           output_type="latent", guidance_scale=scale, num_outputs_per_prompt=n,
                                           use_tqdm=False, **SAMPLING)
                want, want_latents = diffusers_call(self.diffusers, prompt, seed, negative_prompt=negative or "",
                                                    guidance_scale=scale, num_images_per_prompt=n, **SAMPLING)
                got = torch.stack(out.images)  # output_type="pt": one [3, H, W] tensor per image
                assert got.shape == want.shape and torch.equal(got, want), \
                    f"seed {seed}: max diff {(got - want).abs().max().item():.3g}"
                assert torch.equal(torch.stack(latents.images), want_latents), f"seed {seed}: final latents differ"

    def test_the_text_padding_mask_matters(self, monkeypatch):
        """T5 pads every prompt to max_sequence_length: attending to the padding (mask dropped in the attention
        processor) moves the image far outside the tolerance, so the parity checks see the mask."""
        import omni_model_pixart.attention as attention

        case = self.case(1, self.seeds[1])
        monkeypatch.setattr(attention, "key_padding_mask", lambda bias: None)
        state = self.make_state(case)
        (out,) = self.omni.forward([state])
        assert levels_apart(out.tensor, self.reference(case)[0]) > 5

"""diffusers' HunyuanVideo 1.5 pipelines as the parity reference of the plugin's tests (needs pytest).

Their ``__call__`` takes no ``guidance_scale`` (the folder's guider holds it) and no ``callback_on_step_end``, so
:class:`HunyuanParity` sets a ``ClassifierFreeGuidance`` of the case's scale, runs diffusers to its final latents
(``output_type="latent"``) and decodes them with diffusers' own three lines. ``SHORT_PADDING``: diffusers pads
the Qwen text to 1000 tokens, ByT5 to 256 and the image tokens to 729, all masked; the memoised references run with
shorter masked padding (every test prompt still fits: a truncated one would fail parity), which computes the same
valid tokens 3-4x faster; ``test_full_padding_equals_short_padding`` checks one case at diffusers' own lengths.
"""

from __future__ import annotations

from typing import Any

import torch

from omni_core.testing import DiffusersParityContract
from omni_core.testing.parity_harness import _REFERENCES

SHORT_PADDING = {"tokenizer_max_length": 512, "tokenizer_2_max_length": 32}
SHORT_IMAGE_TOKENS = 8  # text-to-video: diffusers' zero image embeddings (masked); I2V uses SigLIP's own count


def diffusers_reference(pipe: Any, prompt: str, negative: str | None, seed: int, guidance_scale: float,
                        **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers' video ``[n, F, 3, H, W]`` and final latents for one prompt."""
    from diffusers import ClassifierFreeGuidance

    pipe.guider = ClassifierFreeGuidance(guidance_scale=guidance_scale)
    latents = pipe(prompt=prompt, negative_prompt=negative, output_type="latent",
                   generator=torch.Generator("cpu").manual_seed(seed), **kwargs)[0]
    with torch.no_grad():  # HunyuanVideo15Pipeline.__call__'s decode, verbatim
        video = pipe.vae.decode(latents.to(pipe.vae.dtype) / pipe.vae.config.scaling_factor, return_dict=False)[0]
        video = pipe.video_processor.postprocess_video(video, output_type="pt")
    return video, latents


def short_padding(pipe: Any) -> Any:
    for name, value in SHORT_PADDING.items():
        setattr(pipe, name, value)
    if not hasattr(pipe, "image_encoder"):
        pipe.vision_num_semantic_tokens = SHORT_IMAGE_TOKENS
    return pipe


class HunyuanParity(DiffusersParityContract):
    #: 3 steps: the staggered check admits requests at waves 0, 1, 2 and needs them all in one wave
    sampling = {"num_inference_steps": 3, "height": 16, "width": 16, "num_frames": 5}
    outputs_kwarg = "num_videos_per_prompt"
    cfg_scale, cfg_off = 4.0, 1.0
    other_size = {"width": 24}
    #: diffusers' VAE decodes a batch of one only (its causal attention mask does not broadcast), so its
    #: ``num_videos_per_prompt=2`` fails: the several-outputs check has no reference (Omni's decode goes row by row)
    non_square: dict = {}

    def reference(self, case: dict[str, Any]) -> tuple[Any, Any]:
        key = (id(self.diffusers), tuple(sorted(case.items())))
        if key not in _REFERENCES:
            prompt, seed, negative, _, _ = self._split(case)
            kwargs = self.reference_kwargs(case)
            scale = kwargs.pop("guidance_scale")
            _REFERENCES[key] = diffusers_reference(short_padding(self.diffusers), prompt, negative, seed, scale,
                                                   **kwargs)
        return _REFERENCES[key]

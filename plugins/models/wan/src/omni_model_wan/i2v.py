"""Omni's ``WanImageToVideoPipeline``: Wan image-to-video on :class:`~omni_model_wan.pipeline.WanPipeline`.

The request's image (resized to the output size by diffusers' ``video_processor``) is VAE-encoded as the
first frame of a zero video by diffusers' own ``prepare_latents``; what the transformer sees depends on the
folder, as in diffusers:

* Wan 2.1 I2V (``image_encoder``): ``[noise, mask, condition]`` concatenated on channels, plus the CLIP
  image embeddings (``encoder_hidden_states_image``, the same for both CFG branches);
* Wan 2.2 I2V-A14B (two experts, ``boundary_ratio``, no image encoder): the same concatenation, no embeddings;
* ``expand_timesteps`` (Wan 2.2 TI2V-5B): the first latent frame replaced by the condition, its tokens at
  timestep 0, and the final latents blended with the condition.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from omni_core.config import SamplingParams
from omni_core.errors import ConfigError
from omni_core.images import ImageInput, to_pil
from omni_core.pipelines import StepState
from omni_core.pipelines.diffusers_step import folder_config
from omni_model_wan.attention import TEXT_CONTEXT_LENGTH
from omni_model_wan.pipeline import WanPipeline


class WanImageToVideoPipeline(WanPipeline):
    """Wan image-to-video (diffusers ``WanImageToVideoPipeline`` semantics); one input image per request."""

    diffusers_class = "WanImageToVideoPipeline"
    #: every image is resized to the output size, which is already in the batch key
    image_input: ClassVar[ImageInput] = ImageInput(min_images=1, max_images=1, size_splits_batch=False,
                                                  role="the first frame of the video")

    @classmethod
    def check_sampling_params(cls, params: SamplingParams, model_path: str | None = None) -> SamplingParams:
        """As :class:`WanPipeline`; a Wan 2.1 I2V transformer (``image_dim``) splits its context into image and
        text tokens at 512, so ``max_sequence_length`` must be 512 there (diffusers computes garbage otherwise)."""
        params = super().check_sampling_params(params, model_path)
        if (folder_config(model_path, "transformer") or {}).get("image_dim") is not None \
                and params.max_sequence_length != TEXT_CONTEXT_LENGTH:
            raise ConfigError(f"max_sequence_length={params.max_sequence_length} is not allowed for this Wan 2.1 "
                              f"image-to-video model: its transformer takes exactly {TEXT_CONTEXT_LENGTH} text "
                              f"tokens after the image tokens; use {TEXT_CONTEXT_LENGTH}", field="max_sequence_length")
        return params

    def __init__(self, pipe: Any, device: torch.device, dtype: torch.dtype, layers: list) -> None:
        super().__init__(pipe, device, dtype, layers)
        transformer = pipe.transformer
        #: Wan 2.1 I2V: the first expert takes CLIP image embeddings (diffusers checks the first one only)
        self.uses_image_embeds = transformer is not None and transformer.config.image_dim is not None

    def prepare_latents(self, state: StepState) -> None:
        """Noise, condition (and Wan 2.1's image embeddings) exactly as diffusers' ``__call__`` makes them."""
        pipe, sp = self.pipe, state.sampling_params
        if not state.request.images:
            raise ConfigError(f"{type(self).__name__} needs {self.image_input.role}: give 'image' with 1 image",
                              field="image")
        image = to_pil(state.request.images[0])
        n = sp.num_outputs_per_prompt
        with torch.no_grad():
            if self.uses_image_embeds:  # one row; expanded to the request's rows in extra_inputs
                state.extra["image_embeds"] = pipe.encode_image(image, self.device).to(self.transformer_dtype)
            pixels = pipe.video_processor.preprocess(image, height=sp.height, width=sp.width)
            out = pipe.prepare_latents(pixels.to(self.device, dtype=torch.float32), n, pipe.vae.config.z_dim,
                                       sp.height, sp.width, sp.num_frames, torch.float32, self.device, state.generator)
        state.latents, state.extra["condition"] = out[0], out[1]
        if self.expand_timesteps:
            state.extra["first_frame_mask"] = out[2]

    def model_input(self, state: StepState) -> torch.Tensor:
        cond = state.extra["condition"]
        if self.expand_timesteps:
            mask = state.extra["first_frame_mask"]
            return (1 - mask) * cond + mask * state.latents
        return torch.cat([state.latents, cond], dim=1)

    def token_timesteps(self, states: list[StepState], timestep: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        """The first latent frame's tokens (the image) at timestep 0, the others at the row's timestep."""
        mask = states[0].extra["first_frame_mask"][0][0][:, ::self.patch_size[1], ::self.patch_size[2]].flatten()
        return mask[None, :] * timestep[:, None]

    def extra_inputs(self, segments: list[tuple[StepState, str]]) -> dict:
        if not self.uses_image_embeds:
            return {}
        embeds = [s.extra["image_embeds"].expand(s.latents.shape[0], -1, -1) for s, _ in segments]
        return {"encoder_hidden_states_image": embeds[0] if len(embeds) == 1 else torch.cat(embeds)}

    def step_scheduler(self, state: StepState, noise_pred: torch.Tensor) -> None:
        super().step_scheduler(state, noise_pred)
        if self.expand_timesteps and state.step_index == state.num_steps:  # diffusers' final blend
            mask = state.extra["first_frame_mask"]
            state.latents = (1 - mask) * state.extra["condition"] + mask * state.latents

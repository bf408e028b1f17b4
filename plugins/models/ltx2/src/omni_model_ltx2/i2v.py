"""Omni's ``LTX2ImageToVideoPipeline``: LTX-2 image-to-video with its audio track, on
:class:`~omni_model_ltx2.pipeline.LTX2Pipeline`.

What differs from text-to-video, as in diffusers' ``LTX2ImageToVideoPipeline`` (0.42.1): the request's image is
re-compressed as H.264 at ``image_crf`` (diffusers' ``apply_image_conditioning_crf``, PyAV), resized to the output
size by diffusers' ``video_processor`` and VAE-encoded as the first latent frame by diffusers' own
``prepare_latents`` (which also draws the noise and the conditioning mask); that frame's tokens see timestep 0
(per-token video timesteps, the audio keeps the row's), and a scheduler step leaves them as they are (diffusers
steps frames 1.. only; the Euler step is elementwise, so stepping all and restoring the first frame is the same).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from omni_core.errors import ConfigError
from omni_core.images import ImageInput, to_pil
from omni_core.pipelines import StepState
from omni_model_ltx2.fields import I2V_SAMPLING_FIELDS
from omni_model_ltx2.pipeline import LTX2Pipeline


class LTX2ImageToVideoPipeline(LTX2Pipeline):
    """LTX-2 image-to-video + audio (diffusers ``LTX2ImageToVideoPipeline`` semantics); one image per request."""

    diffusers_class = "LTX2ImageToVideoPipeline"
    #: every image is resized to the output size, which is already in the batch key
    image_input: ClassVar[ImageInput] = ImageInput(min_images=1, max_images=1, size_splits_batch=False,
                                                  role="the first frame of the video")
    sampling_fields = I2V_SAMPLING_FIELDS
    #: the video VAE also encodes the input image on the denoise side
    stage_components: ClassVar[dict] = {**LTX2Pipeline.stage_components, "denoise": ("vae",)}

    def crf(self, state: StepState) -> int:
        """The request's ``image_crf``, else the model's (diffusers' ``resolve_default_image_crf`` of the text
        encoder, read from the folder's config where the encoder lives in the encode process)."""
        from diffusers.pipelines.ltx2.utils import resolve_default_image_crf

        if state.sampling_params.image_crf is not None:
            return state.sampling_params.image_crf
        encoder = self.pipe.text_encoder
        if encoder is None:
            from types import SimpleNamespace

            from omni_core.pipelines.diffusers_step import folder_config
            from omni_core.pipelines.denoiser import model_folder_of

            config = folder_config(model_folder_of(self), "text_encoder") or {}
            encoder = SimpleNamespace(config=SimpleNamespace(model_type=config.get("model_type")))
        return resolve_default_image_crf(encoder)

    def initial_latents(self, state: StepState) -> tuple[torch.Tensor, torch.Tensor]:
        """The image (re-compressed, resized) as the first latent frame and the noise, drawn by diffusers' own
        ``prepare_latents`` from the request's generator; then the audio noise, as diffusers orders them."""
        import numpy as np
        import PIL.Image
        from diffusers.pipelines.ltx2.utils import apply_image_conditioning_crf

        pipe, sp = self.pipe, state.sampling_params
        if not state.request.images:
            raise ConfigError(f"{type(self).__name__} needs {self.image_input.role}: give 'image' with 1 image",
                              field="image")
        image = to_pil(state.request.images[0])
        crf = self.crf(state)
        if crf != 0:
            image = PIL.Image.fromarray(apply_image_conditioning_crf(np.array(image.convert("RGB")), crf))
        n = sp.num_outputs_per_prompt
        with torch.no_grad():
            pixels = pipe.video_processor.preprocess(image, height=sp.height, width=sp.width)
            video, mask = pipe.prepare_latents(pixels.to(self.device, dtype=self.transformer_dtype), n,
                                               self.in_channels, sp.height, sp.width, sp.num_frames, 0.0,
                                               torch.float32, self.device, state.generator)
        state.extra["condition_mask"] = mask[:1]  # [1, S]: 1 on the first latent frame's tokens
        audio = pipe.prepare_audio_latents(n, pipe.audio_vae.config.latent_channels, state.extra["audio_frames"],
                                           pipe.audio_vae.config.mel_bins, 0.0, torch.float32, self.device,
                                           state.generator)
        return video, audio

    def transformer_inputs(self, segments: list[tuple[StepState, str]]) -> dict:
        """As text-to-video, with per-token video timesteps (0 on the image's tokens) and the row's timestep for
        the audio."""
        kwargs = super().transformer_inputs(segments)
        rows = [s.latents.shape[0] for s, _ in segments]
        masks = torch.cat([s.extra["condition_mask"].expand(r, -1) for (s, _), r in zip(segments, rows)])
        t = kwargs["timestep"]
        kwargs["timestep"] = t.unsqueeze(-1) * (1 - masks)
        kwargs["audio_timestep"] = t
        return kwargs

    def step_scheduler(self, state: StepState, noise_pred: Any) -> None:
        """The flow step of the joined state, the image's tokens restored (diffusers steps frames 1.. only)."""
        before = self.split_latents(state)[0]
        super().step_scheduler(state, noise_pred)
        video = self.split_latents(state)[0]
        keep = state.extra["condition_mask"][..., None].bool()
        video.copy_(torch.where(keep, before, video))

"""Omni's ``HunyuanVideo15ImageToVideoPipeline``: HunyuanVideo 1.5 image-to-video on
:class:`~omni_model_hunyuan_video15.pipeline.HunyuanVideo15Pipeline`.

What differs from text-to-video, each step done by diffusers' own ``HunyuanVideo15ImageToVideoPipeline`` helpers
on the request's exact PIL image:

* **the size** is the image's: the bucket of the transformer's ``target_size`` closest to the image's aspect
  ratio (``video_processor.calculate_default_height_width``), the image resized and centre-cropped to it. As in
  diffusers, a request's ``height``/``width`` are not used; requests whose images land in different buckets run in
  different denoiser calls (one per latent size);
* **the condition channels**: the image VAE-encoded (``argmax``, times ``scaling_factor``) in the first latent
  frame, zeros after it, and a mask that is 1 on the first frame (``prepare_cond_latents_and_mask``);
* **SigLIP image embeddings** (``encode_image``) join the condition tokens of both CFG branches;
* **MeanFlow** folders (``use_meanflow``: the step-distilled ones) get ``timestep_r``, the next timestep (0 at the
  last step), per row.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from omni_core.errors import ConfigError
from omni_core.images import ImageInput, to_pil
from omni_core.pipelines import StepState
from omni_model_hunyuan_video15.pipeline import HunyuanVideo15Pipeline


class HunyuanVideo15ImageToVideoPipeline(HunyuanVideo15Pipeline):
    """HunyuanVideo 1.5 image-to-video (diffusers ``HunyuanVideo15ImageToVideoPipeline`` semantics)."""

    diffusers_class = "HunyuanVideo15ImageToVideoPipeline"
    #: the image decides the output size, so images of other sizes must not share a wave's size assumptions
    image_input: ClassVar[ImageInput] = ImageInput(min_images=1, max_images=1, size_splits_batch=True,
                                                  role="the first frame of the video")

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        #: MeanFlow (step-distilled) folders take ``timestep_r``
        self.use_meanflow = bool(self.pipe.transformer.config.get("use_meanflow", False))

    def prepare_latents(self, state: StepState) -> None:
        pipe, sp = self.pipe, state.sampling_params
        if not state.request.images:
            raise ConfigError(f"{type(self).__name__} needs {self.image_input.role}: give 'image' with 1 image",
                              field="image")
        image = to_pil(state.request.images[0])
        height, width = pipe.video_processor.calculate_default_height_width(
            height=image.size[1], width=image.size[0], target_size=pipe.target_size)
        image = pipe.video_processor.resize(image, height=height, width=width, resize_mode="crop")
        n = sp.num_outputs_per_prompt
        with torch.no_grad():
            embeds = pipe.encode_image(image=image, batch_size=1, device=self.device, dtype=self.transformer_dtype)
            latents = pipe.prepare_latents(n, self.latent_channels, height, width, sp.num_frames, torch.float32,
                                           self.device, state.generator)
            cond, mask = pipe.prepare_cond_latents_and_mask(latents=latents, image=image, batch_size=n, height=height,
                                                            width=width, dtype=torch.float32, device=self.device)
        state.latents = latents
        state.extra.update(image_embeds=embeds, condition=torch.cat([cond, mask], dim=1), height=height, width=width)

    def condition(self, state: StepState) -> torch.Tensor:
        return state.extra["condition"]

    def image_embeds(self, segments: list[tuple[StepState, str]], rows: int) -> torch.Tensor:
        """Each segment's SigLIP embeddings, one copy per row (the same for the cond and uncond branch)."""
        parts = [s.extra["image_embeds"].expand(s.latents.shape[0], -1, -1) for s, _ in segments]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def extra_inputs(self, segments: list[tuple[StepState, str]]) -> dict:
        """MeanFlow's ``timestep_r``: each row's next timestep, 0 at the last step (diffusers' rule)."""
        if not self.use_meanflow:
            return {}
        parts = []
        for s, _ in segments:
            i = s.step_index
            t = s.timesteps[i + 1] if i + 1 < len(s.timesteps) else torch.tensor(0.0, device=self.device)
            parts.append(t.expand(s.latents.shape[0]))
        return {"timestep_r": torch.cat(parts).to(self.transformer_dtype)}

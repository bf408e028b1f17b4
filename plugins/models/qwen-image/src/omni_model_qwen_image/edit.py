"""Omni's ``QwenImageEditPipeline``: Qwen-Image-Edit (one input image + an instruction), on QwenImagePipeline.

What differs from text-to-image, all as diffusers' ``QwenImageEditPipeline`` computes it:

* the input image is resized to ~1 MP keeping its aspect ratio (``calculate_dimensions``); the output size
  defaults to that size;
* the prompt is encoded by Qwen2.5-VL together with that image (the processor's vision tokens), so a text
  encoding is keyed by (text, image) and a wave's (text, image) pairs are still encoded in one call;
* the image's VAE latents (packed) are the condition: appended to the noisy latents along the sequence,
  ``img_shapes`` lists both layouts, and the first part of the output is the noise prediction.

Requests whose input images differ in size have different condition lengths, so they never share a wave
(``size_splits_batch``; :meth:`QwenImageEditPipeline.batch_key` agrees in step mode).
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import torch

from omni_core.errors import ConfigError
from omni_core.images import ImageInput, to_pil
from omni_core.pipelines import StepState
from omni_model_qwen_image.pipeline import QwenImagePipeline

#: diffusers resizes the input to this area (keeping the aspect ratio) for both the VL encoder and the VAE
CONDITION_AREA = 1024 * 1024
#: the engine's start-up warmup request (``omni_core.engine``: ``warmup-<hex>``) carries no image; it edits a
#: black one of its output size. Every other request without one is refused in the engine (``image_input``).
#: Remove once the core's warmup brings an image (CORE_CHANGES.md).
WARMUP_PREFIX = "warmup-"


@dataclasses.dataclass(frozen=True)
class TextImageKey:
    """One (text, image) encoding: equal when the text and the image's pixels are."""

    text: str
    digest: str
    image: Any = dataclasses.field(compare=False, repr=False)


@dataclasses.dataclass
class Condition:
    """A request's input image as diffusers prepares it: resized PIL (for the VL encoder), its size, digest."""

    image: Any
    height: int
    width: int
    digest: str


class QwenImageEditPipeline(QwenImagePipeline):
    """Qwen-Image-Edit (diffusers ``QwenImageEditPipeline`` semantics, float-exact denoise math)."""

    diffusers_class = "QwenImageEditPipeline"
    image_input = ImageInput(min_images=1, max_images=1, size_splits_batch=True, role="the image to edit")
    size_from_input = True

    @classmethod
    def load(cls, model_path: str, config: Any = None, device: Any = "cpu", dtype: Any = None):
        """As the base, with the folder's processor loaded by :func:`~omni_model_qwen_image.processor.load_processor`
        (which works without torchvision) and handed to diffusers' ``from_pretrained``."""
        import attrs

        from omni_core.config import OmniDiffusionConfig
        from omni_model_qwen_image.processor import load_processor

        config = config if config is not None else OmniDiffusionConfig(model=model_path)
        kwargs = dict(config.model_kwargs or {})
        if "processor" not in kwargs:
            kwargs["processor"] = load_processor(model_path)
        return super().load(model_path, attrs.evolve(config, model_kwargs=kwargs), device, dtype)

    @classmethod
    def check_images(cls, request: Any, limits: Any) -> Any:
        """The core's check, once: ``Omni.generate`` prepares each request and ``engine.submit`` prepares it
        again, when its images are already ``uint8`` tensors (see CORE_CHANGES.md)."""
        if request.images and all(hasattr(im, "dtype") and hasattr(im, "shape") for im in request.images):
            return request
        return super().check_images(request, limits)

    # -- the input image
    def condition(self, state: StepState) -> Condition:
        """The request's input image resized as diffusers does (computed once per request)."""
        from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions

        cond = state.extra.get("condition")
        if cond is None:
            images = state.request.images
            if not images and str(state.request.request_id).startswith(WARMUP_PREFIX):
                images = [torch.zeros(3, state.sampling_params.height, state.sampling_params.width, dtype=torch.uint8)]
            if len(images) != 1:
                raise ConfigError(f"{type(self).__name__} needs exactly one input image in 'image' (got "
                                  f"{len(images)})", field="image")
            pil = to_pil(images[0])
            width, height, _ = calculate_dimensions(CONDITION_AREA, pil.width / pil.height)
            digest = hashlib.blake2b(images[0].cpu().numpy().tobytes(), digest_size=16).hexdigest()
            digest += f":{tuple(images[0].shape)}"
            cond = Condition(self.pipe.image_processor.resize(pil, height, width), height, width, digest)
            state.extra["condition"] = cond
        return cond

    def output_size(self, state: StepState) -> tuple[int, int]:
        """The requested size, else the condition's (diffusers' default), floored to the packing multiple."""
        sp, cond = state.sampling_params, self.condition(state)
        multiple = self.pipe.vae_scale_factor * 2
        return ((sp.height or cond.height) // multiple * multiple, (sp.width or cond.width) // multiple * multiple)

    def initial_latents(self, state: StepState, height: int, width: int) -> torch.Tensor:
        """The noise, and the image's packed VAE latents (``state.extra["image_latents"]``, one row per output)."""
        cond = self.condition(state)
        image = self.pipe.image_processor.preprocess(cond.image, cond.height, cond.width).unsqueeze(2)
        latents, image_latents = self.pipe.prepare_latents(
            image, state.sampling_params.num_outputs_per_prompt, self.transformer.config.in_channels // 4, height,
            width, state.prompt_embeds.dtype, self.device, state.generator)
        vsf = self.pipe.vae_scale_factor
        state.extra.update(image_latents=image_latents, image_shape=(1, cond.height // vsf // 2, cond.width // vsf // 2))
        return latents

    # -- text: encoded with the image
    def _encode(self, state: StepState, text: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """diffusers' edit ``encode_prompt``: no ``max_sequence_length`` cut (it ignores it)."""
        key = self.text_key(state, text)
        memo = self._text_memo
        return (memo[key] if memo is not None and key in memo else self.encode_prompts([key])[key]), None

    def text_key(self, state: StepState, text: str) -> TextImageKey:
        cond = self.condition(state)
        return TextImageKey(text, cond.digest, cond.image)

    def embed_texts(self, keys: list) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pipe._get_qwen_prompt_embeds([k.text for k in keys], [k.image for k in keys], self.device)

    # -- the denoiser call
    def batch_key(self, state: StepState) -> tuple:
        """The base's key and the input image sizes (the condition's token count follows them)."""
        return (*super().batch_key(state), tuple(tuple(im.shape) for im in state.request.images))

    def image_tokens(self, states: list[StepState], latents: torch.Tensor) -> tuple[torch.Tensor, list]:
        """[noisy latents, condition latents] per row; ``img_shapes`` lists both layouts."""
        _, shapes = super().image_tokens(states, latents)
        cond = torch.cat([s.extra["image_latents"] for s in states]) if len(states) > 1 else states[0].extra["image_latents"]
        image_shape = states[0].extra["image_shape"]
        return torch.cat([latents, cond], dim=1), [[*shape, image_shape] for shape in shapes]

    def noise_predictions(self, preds: list[torch.Tensor], states: list[StepState]) -> list[torch.Tensor]:
        """The first ``S`` tokens of each output (the rest predicts the condition tokens, unused)."""
        return [p[:, :s.latents.shape[1]] for p, s in zip(preds, states)]

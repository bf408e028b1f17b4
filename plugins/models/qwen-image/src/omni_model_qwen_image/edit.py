"""Omni's ``QwenImageEditPipeline`` (one input image + an instruction) and ``QwenImageEditPlusPipeline`` (1-3
images), on QwenImagePipeline.

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


@dataclasses.dataclass(frozen=True)
class TextImageKey:
    """One (text, images) encoding: equal when the text and the input images' pixels are."""

    text: str
    digest: str
    images: Any = dataclasses.field(compare=False, repr=False)


@dataclasses.dataclass
class Condition:
    """A request's input images as diffusers prepares them: what the VL encoder sees (``vl_images``), the VAE
    inputs ``[1, 3, 1, H, W]`` and their sizes, the default output size, and a digest of the pixels."""

    vl_images: Any
    vae_images: list
    vae_sizes: list
    size: tuple[int, int]
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
        from omni_core.pipelines.diffusers_folder import check_model_index
        from omni_model_qwen_image.processor import load_processor

        check_model_index(model_path, cls.diffusers_class)  # a wrong folder is refused before anything is read
        config = config if config is not None else OmniDiffusionConfig(model=model_path)
        kwargs = dict(config.model_kwargs or {})
        if "processor" not in kwargs and (processor := load_processor(model_path)) is not None:
            kwargs["processor"] = processor
        return super().load(model_path, attrs.evolve(config, model_kwargs=kwargs), device, dtype)

    # -- the input image
    def condition(self, state: StepState) -> Condition:
        """The request's input images prepared as diffusers does (once per request)."""
        cond = state.extra.get("condition")
        if cond is None:
            images = list(state.request.images)
            spec = self.image_input
            if not spec.min_images <= len(images) <= spec.max_images:
                raise ConfigError(f"{type(self).__name__} takes {spec.min_images} to {spec.max_images} input images "
                                  f"in 'image' (got {len(images)})", field="image")
            digest = hashlib.blake2b(digest_size=16)
            for im in images:
                digest.update(repr(tuple(im.shape)).encode())
                digest.update(im.cpu().numpy().tobytes())
            cond = state.extra["condition"] = self.prepare_condition([to_pil(im) for im in images], digest.hexdigest())
        return cond

    def prepare_condition(self, images: list, digest: str) -> Condition:
        """diffusers' edit ``__call__``: the image resized to ~1 MP; the VL encoder gets that PIL image, the VAE
        its ``preprocess`` tensor."""
        from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions

        width, height, _ = calculate_dimensions(CONDITION_AREA, images[0].width / images[0].height)
        resized = self.pipe.image_processor.resize(images[0], height, width)
        vae = self.pipe.image_processor.preprocess(resized, height, width).unsqueeze(2)
        return Condition(resized, [vae], [(height, width)], (height, width), digest)

    def vae_input(self, cond: Condition) -> Any:
        """What diffusers' ``prepare_latents`` takes as the image (the edit pipeline: one tensor)."""
        return cond.vae_images[0]

    def output_size(self, state: StepState) -> tuple[int, int]:
        """The requested size, else the condition's (diffusers' default), floored to the packing multiple."""
        sp, (height, width) = state.sampling_params, self.condition(state).size
        multiple = self.pipe.vae_scale_factor * 2
        return (sp.height or height) // multiple * multiple, (sp.width or width) // multiple * multiple

    def initial_latents(self, state: StepState, height: int, width: int) -> torch.Tensor:
        """The noise, and the images' packed VAE latents (``state.extra["image_latents"]``, one row per output,
        the images one after the other along the sequence)."""
        cond = self.condition(state)
        latents, image_latents = self.pipe.prepare_latents(
            self.vae_input(cond), state.sampling_params.num_outputs_per_prompt,
            self.transformer.config.in_channels // 4, height, width, state.prompt_embeds.dtype, self.device,
            state.generator)
        vsf = self.pipe.vae_scale_factor
        state.extra.update(image_latents=image_latents,
                           image_shapes=[(1, h // vsf // 2, w // vsf // 2) for h, w in cond.vae_sizes],
                           condition=dataclasses.replace(cond, vl_images=None, vae_images=[]))  # ~1 MP copies: free
        return latents

    # -- text: encoded with the image
    def _encode(self, state: StepState, text: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """diffusers' edit ``encode_prompt``: no ``max_sequence_length`` cut (it ignores it)."""
        key = self.text_key(state, text)
        return self.encoded_text(state, key, lambda: self.encode_prompts([key])[key]), None

    def text_key(self, state: StepState, text: str) -> TextImageKey:
        cond = self.condition(state)
        return TextImageKey(text, cond.digest, cond.vl_images)

    def text_cache_key(self, key: TextImageKey) -> tuple[str, str]:
        """The text and the images' digest (the embedding cache keeps no images)."""
        return key.text, key.digest

    def embed_texts(self, keys: list) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pipe._get_qwen_prompt_embeds([k.text for k in keys], [k.images for k in keys], self.device)

    # -- the denoiser call
    def batch_key(self, state: StepState) -> tuple:
        """The base's key and the input image sizes (the condition's token count follows them)."""
        return (*super().batch_key(state), tuple(tuple(im.shape) for im in state.request.images))

    def image_tokens(self, states: list[StepState], latents: torch.Tensor) -> tuple[torch.Tensor, list]:
        """[noisy latents, condition latents] per row; ``img_shapes`` lists every layout."""
        _, shapes = super().image_tokens(states, latents)
        cond = torch.cat([s.extra["image_latents"] for s in states]) if len(states) > 1 else states[0].extra["image_latents"]
        image_shapes = states[0].extra["image_shapes"]
        return torch.cat([latents, cond], dim=1), [[*shape, *image_shapes] for shape in shapes]

    def noise_predictions(self, preds: list[torch.Tensor], states: list[StepState]) -> list[torch.Tensor]:
        """The first ``S`` tokens of each output (the rest predicts the condition tokens, unused)."""
        return [p[:, :s.latents.shape[1]] for p, s in zip(preds, states)]


class QwenImageEditPlusPipeline(QwenImageEditPipeline):
    """Qwen-Image-Edit-2509 and later: 1 to 3 input images (diffusers ``QwenImageEditPlusPipeline``). Each
    image is seen by the VL encoder at ~384x384 ("Picture i:" in the prompt) and by the VAE at ~1 MP; the
    condition is all images' latents in order; the output size defaults to the last image's ~1 MP size."""

    diffusers_class = "QwenImageEditPlusPipeline"
    image_input = ImageInput(min_images=1, max_images=3, size_splits_batch=True, role="the images to edit")

    def prepare_condition(self, images: list, digest: str) -> Condition:
        from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import (
            CONDITION_IMAGE_SIZE, VAE_IMAGE_SIZE, calculate_dimensions)

        vl, vae, sizes = [], [], []
        for image in images:
            cw, ch = calculate_dimensions(CONDITION_IMAGE_SIZE, image.width / image.height)
            vw, vh = calculate_dimensions(VAE_IMAGE_SIZE, image.width / image.height)
            vl.append(self.pipe.image_processor.resize(image, ch, cw))
            vae.append(self.pipe.image_processor.preprocess(image, vh, vw).unsqueeze(2))
            sizes.append((vh, vw))
        return Condition(vl, vae, sizes, sizes[-1], digest)

    def vae_input(self, cond: Condition) -> Any:
        return cond.vae_images

    def encode_prompts(self, keys: list) -> dict:
        """One VL call per (text, images): diffusers' Plus template numbers the images of ONE prompt, so its
        ``_get_qwen_prompt_embeds`` takes one prompt at a time (as its ``__call__`` does)."""
        with torch.no_grad():
            return {key: self.pipe._get_qwen_prompt_embeds([key.text], key.images, self.device)[0] for key in keys}

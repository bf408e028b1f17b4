"""Tiny random-weight Qwen-Image folders for tests and benchmarks (no download, tokenizer built offline).

``build_tiny_qwen_image(path)`` writes a diffusers-format folder that both Omni's ``QwenImagePipeline`` and
diffusers' own ``DiffusionPipeline.from_pretrained`` load; it lives in :mod:`omni_core.testing.diffusers_folders`
(other plugins' tests build the same folder) and is re-exported here. The edit variants need this plugin's
processor and stay here. Configs follow diffusers' own pipeline tests.
"""

from __future__ import annotations

import os

from omni_core.testing.diffusers_folders import build_tiny_qwen_image, qwen_tokenizer, tiny_qwen_image_components

__all__ = ["build_tiny_qwen_image", "qwen_tokenizer", "tiny_qwen_image_components", "qwen_vl_tokenizer",
           "tiny_qwen_vl_processor", "tiny_qwen_image_edit_components", "build_tiny_qwen_image_edit",
           "diffusers_reference_kwargs"]


#: the Qwen2-VL vision specials the edit prompt template and processor use, appended after the ChatML ones
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def qwen_vl_tokenizer():
    """:func:`qwen_tokenizer` plus the vision specials (ids 259..262), so ``<|image_pad|>`` is one token that
    Qwen2.5-VL replaces with image features."""
    from tokenizers import AddedToken

    tok = qwen_tokenizer()
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS], special_tokens=True)
    return tok


def tiny_qwen_vl_processor(max_pixels: int = 56 * 56):
    """A ``Qwen2VLProcessor`` built offline: the (PIL) Qwen2-VL image processor, capped at ``max_pixels`` so
    the vision tower sees a few patches (the edit pipeline hands it a ~1 MP copy of the input), and
    :func:`qwen_vl_tokenizer`. Without torchvision it is the plugin's stand-in subclass (no video processor)."""
    from omni_model_qwen_image.processor import image_processor_class, processor_class

    image_processor = image_processor_class()(min_pixels=28 * 28, max_pixels=max_pixels,
                                              size={"shortest_edge": 28 * 28, "longest_edge": max_pixels})
    return processor_class()(image_processor=image_processor, tokenizer=qwen_vl_tokenizer())


def tiny_qwen_image_edit_components(num_layers: int = 2, sharpen: float = 4.0, num_heads: int = 3,
                                    condition_gain: float = 20.0) -> dict:
    """Qwen-Image-Edit components: the Qwen-Image transformer and text encoder of
    :func:`tiny_qwen_image_components` (the text encoder's vision ids point at :data:`VISION_TOKENS`), a VAE
    with 16x downsampling, and the processor. diffusers always encodes the input at ~1024x1024; this VAE (4
    downsampling levels of 4 channels, no encoder res-blocks: diffusers' 3-D convolutions at full resolution
    cost seconds each on CPU) keeps that at ~1000 condition tokens and under a second of CPU per encode,
    where diffusers' own test VAE (x4) would give 16384 tokens. ``condition_gain`` scales the encoder's
    output conv: the random encoder gives latents of std ~0.05, with which the input image moved the edit by
    a few levels only; x20 makes it move the image by many, so parity tests see the condition path."""
    import torch
    from diffusers import AutoencoderKLQwenImage
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    components = tiny_qwen_image_components(num_layers, sharpen, num_heads)
    tok = qwen_vl_tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    torch.manual_seed(0)
    components["vae"] = AutoencoderKLQwenImage(
        base_dim=4, z_dim=4, dim_mult=[1, 1, 1, 1, 1], num_res_blocks=0, temperal_downsample=[False, True, True, True],
        latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
    with torch.no_grad():
        components["vae"].quant_conv.weight.mul_(condition_gain)
        components["vae"].quant_conv.bias.mul_(condition_gain)
    torch.manual_seed(0)
    components["text_encoder"] = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config={"hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
                     "num_key_value_heads": 2, "rope_theta": 1e6, "vocab_size": 320,
                     "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"}},
        vision_config={"depth": 2, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": 16},
        hidden_size=16, vocab_size=320, vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"])).eval()
    components["tokenizer"] = tok
    components["processor"] = tiny_qwen_vl_processor()
    return components


def build_tiny_qwen_image_edit(path: str | os.PathLike, num_layers: int = 2, sharpen: float = 4.0,
                               num_heads: int = 3, plus: bool = False, condition_gain: float = 20.0) -> str:
    """Save a tiny random Qwen-Image-Edit pipeline (``QwenImageEditPlusPipeline`` with ``plus``) into
    ``path``; returns the folder. The processor is recorded as transformers' ``Qwen2VLProcessor``, as in
    released folders, whichever class built it."""
    import diffusers

    from omni_model_qwen_image.processor import record_as_qwen2vl_processor

    path = os.fspath(path)
    cls = getattr(diffusers, "QwenImageEditPlusPipeline" if plus else "QwenImageEditPipeline")
    cls(**tiny_qwen_image_edit_components(num_layers, sharpen, num_heads, condition_gain)).save_pretrained(path, safe_serialization=True)
    record_as_qwen2vl_processor(path)
    return path


def diffusers_reference_kwargs(folder: str) -> dict:
    """What diffusers' own ``DiffusionPipeline.from_pretrained`` needs for an edit folder here: the processor,
    handed in because transformers cannot load ``Qwen2VLProcessor`` without torchvision (``processor.py``)."""
    from omni_model_qwen_image.processor import load_processor

    return {"processor": load_processor(folder)}

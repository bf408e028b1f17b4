"""Tiny random-weight Z-Image folders for tests and benchmarks (no download, tokenizer built offline).

``build_tiny_z_image(path)`` writes a diffusers-format folder that both Omni's ``ZImagePipeline`` and diffusers'
own ``DiffusionPipeline.from_pretrained`` load. Configs follow diffusers' own pipeline test
(``tests/pipelines/z_image/test_z_image.py``).
"""

from __future__ import annotations

import os

#: the chat template ``ZImagePipeline._encode_prompt`` applies (Qwen3's shape, without the thinking block)
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def qwen_tokenizer():
    """The core's offline byte-level Qwen tokenizer (``omni_core.testing.diffusers_folders``) with the chat template
    Z-Image's pipeline applies."""
    from omni_core.testing.diffusers_folders import qwen_tokenizer as byte_level_qwen_tokenizer

    tok = byte_level_qwen_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_z_image_components(num_layers: int = 2, num_heads: int = 2, sharpen: float = 4.0) -> dict:
    """Components with diffusers' test configs. ``sharpen`` scales the attention QK-norm weights of every
    block: with the plain random init the image tokens attend almost uniformly, so the prompt moves pixels by
    well under one level and parity tests could not see text handling (padding, masks, CFG)."""
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    torch.manual_seed(0)
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=16 * num_heads, n_layers=num_layers,
        n_refiner_layers=1, n_heads=num_heads, n_kv_heads=num_heads, norm_eps=1e-5, qk_norm=True,
        cap_feat_dim=16, rope_theta=256.0, t_scale=1000.0, axes_dims=[8, 4, 4], axes_lens=[256, 32, 32])
    with torch.no_grad():
        # diffusers initialises the pad tokens to zeros: random ones make padding visible to the parity tests
        transformer.x_pad_token.normal_()
        transformer.cap_pad_token.normal_()
        for block in [*transformer.noise_refiner, *transformer.context_refiner, *transformer.layers]:
            block.attention.norm_q.weight.mul_(sharpen)
            block.attention.norm_k.weight.mul_(sharpen)
    torch.manual_seed(0)
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 2,
                        up_block_types=["UpDecoderBlock2D"] * 2, block_out_channels=[32, 64], layers_per_block=1,
                        latent_channels=16, norm_num_groups=32, sample_size=32, scaling_factor=0.3611,
                        shift_factor=0.1159)
    torch.manual_seed(0)
    text_encoder = Qwen3Model(Qwen3Config(hidden_size=16, intermediate_size=16, num_hidden_layers=2,
                                          num_attention_heads=2, num_key_value_heads=2, vocab_size=320,
                                          max_position_embeddings=512)).eval()
    return {"transformer": transformer, "vae": vae, "text_encoder": text_encoder, "tokenizer": qwen_tokenizer(),
            "scheduler": FlowMatchEulerDiscreteScheduler()}


def build_tiny_z_image(path: str | os.PathLike, num_layers: int = 2, num_heads: int = 2, sharpen: float = 4.0) -> str:
    """Save a tiny random Z-Image pipeline (safetensors) into ``path``; returns the folder. ``num_heads`` (2 as
    in diffusers' test; the head size is fixed at 16 by the rotary axes) must be divisible by a Ulysses degree."""
    from diffusers import ZImagePipeline

    path = os.fspath(path)
    ZImagePipeline(**tiny_z_image_components(num_layers, num_heads, sharpen)).save_pretrained(
        path, safe_serialization=True)
    return path

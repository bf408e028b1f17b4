"""Tiny random-weight diffusers folders that tests of more than one distribution need (no download, tokenizer
built offline).

A tiny Qwen-Image folder is what an executor or a parallel layout is checked on beyond the core's tiny DiT (a
real diffusers transformer with joint attention and padded text). Plugins may not import each other, so the
builder lives here, where every plugin's tests reach it; the Qwen-Image plugin's own ``testing`` module
re-exports it and adds the edit variants, which need that plugin's processor. Serving the folder still needs
``omni-model-qwen-image`` installed: it is found by its entry point, as in production.
Configs follow diffusers' own pipeline tests; diffusers and transformers are imported only when called.
"""

from __future__ import annotations

import os


def qwen_tokenizer():
    """Byte-level BPE over the 256 byte symbols plus the ChatML specials; no merges, nothing fetched."""
    from tokenizers import AddedToken, pre_tokenizers
    from transformers import Qwen2Tokenizer

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for t in specials:
        vocab[t] = len(vocab)
    tok = Qwen2Tokenizer(vocab=vocab, merges=[])
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in specials], special_tokens=True)
    return tok


def tiny_qwen_image_components(num_layers: int = 2, sharpen: float = 4.0, num_heads: int = 3) -> dict:
    """Components with diffusers' test configs. ``sharpen`` scales the joint attention's QK-norm weights:
    with the plain random init the image tokens attend almost uniformly over ~130 mostly-template text
    tokens, so the prompt moves pixels by well under one level and parity tests could not see text handling
    (padding, masks, CFG); x4 makes prompts and CFG change the image by several levels. ``num_heads`` (3 as
    in diffusers' tests) must be divisible by a Ulysses degree: 4 serves degrees 2 and 4."""
    import torch
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    transformer = QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=num_layers, attention_head_dim=16,
        num_attention_heads=num_heads, joint_attention_dim=16, guidance_embeds=False, axes_dims_rope=(8, 4, 4))
    with torch.no_grad():
        for block in transformer.transformer_blocks:
            for norm in (block.attn.norm_q, block.attn.norm_k, block.attn.norm_added_q, block.attn.norm_added_k):
                norm.weight.mul_(sharpen)
    torch.manual_seed(0)
    vae = AutoencoderKLQwenImage(base_dim=24, z_dim=4, dim_mult=[1, 2, 4], num_res_blocks=1,
                                 temperal_downsample=[False, True], latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
    torch.manual_seed(0)
    text_encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config={"hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
                     "num_key_value_heads": 2, "rope_theta": 1e6, "vocab_size": 320,
                     "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"}},
        vision_config={"depth": 2, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": 16},
        hidden_size=16, vocab_size=320, vision_end_token_id=300, vision_start_token_id=301,
        vision_token_id=302)).eval()
    return {"transformer": transformer, "vae": vae, "text_encoder": text_encoder, "tokenizer": qwen_tokenizer(),
            "scheduler": FlowMatchEulerDiscreteScheduler()}


def build_tiny_qwen_image(path: str | os.PathLike, num_layers: int = 2, sharpen: float = 4.0,
                          num_heads: int = 3) -> str:
    """Save a tiny random Qwen-Image pipeline (safetensors) into ``path``; returns the folder."""
    from diffusers import QwenImagePipeline

    path = os.fspath(path)
    QwenImagePipeline(**tiny_qwen_image_components(num_layers, sharpen, num_heads)).save_pretrained(path, safe_serialization=True)
    return path

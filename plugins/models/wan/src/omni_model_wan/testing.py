"""Tiny random-weight Wan 2.1 / Wan 2.2 folders for tests and benchmarks (no download, tokenizer built offline).

``build_tiny_wan(path, two_experts=False)`` writes a diffusers-format ``WanPipeline`` folder; with
``two_experts=True`` it is laid out like Wan 2.2 A14B (``transformer_2`` plus ``boundary_ratio``). Configs
follow diffusers' own pipeline tests.
"""

from __future__ import annotations

import os
import string


def t5_tokenizer():
    """Unigram over single characters (no file fetched); UMT5-compatible."""
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [(c, -3.0) for c in string.ascii_letters + string.digits + string.punctuation]
    return T5Tokenizer(vocab=pieces, extra_ids=0)


def tiny_wan_transformer(seed: int = 0, num_layers: int = 2, num_heads: int = 2):
    """``num_heads`` (2 as in diffusers' tests) must be divisible by a Ulysses degree (4 serves 2 and 4)."""
    import torch
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=num_heads, attention_head_dim=12, in_channels=16, out_channels=16,
        text_dim=32, freq_dim=256, ffn_dim=32, num_layers=num_layers, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=32)


def tiny_wan_components(two_experts: bool = False, boundary_ratio: float = 0.875, num_heads: int = 2) -> dict:
    import torch
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler
    from transformers import UMT5Config, UMT5EncoderModel

    transformer = tiny_wan_transformer(0, num_heads=num_heads)
    torch.manual_seed(0)
    vae = AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True])
    torch.manual_seed(0)
    text_encoder = UMT5EncoderModel(UMT5Config(
        vocab_size=128, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4, relative_attention_num_buckets=8,
        is_encoder_decoder=False)).eval()
    components = {"transformer": transformer, "vae": vae, "text_encoder": text_encoder, "tokenizer": t5_tokenizer(),
                  "scheduler": FlowMatchEulerDiscreteScheduler(shift=7.0), "transformer_2": None}
    if two_experts:
        components["transformer_2"] = tiny_wan_transformer(1, num_heads=num_heads)
        components["boundary_ratio"] = boundary_ratio
    return components


def build_tiny_wan(path: str | os.PathLike, two_experts: bool = False, boundary_ratio: float = 0.875,
                   num_heads: int = 2) -> str:
    """Save a tiny random Wan pipeline (safetensors) into ``path``; returns the folder."""
    from diffusers import WanPipeline

    path = os.fspath(path)
    WanPipeline(**tiny_wan_components(two_experts, boundary_ratio, num_heads)).save_pretrained(path, safe_serialization=True)
    return path

"""Tiny random-weight Wan 2.1 / Wan 2.2 folders for tests and benchmarks (no download, tokenizer built offline).

``build_tiny_wan(path, two_experts=False)`` writes a diffusers-format ``WanPipeline`` folder; with
``two_experts=True`` it is laid out like Wan 2.2 A14B (``transformer_2`` plus ``boundary_ratio``).
``build_tiny_wan_i2v(path, wan22=False)`` writes a ``WanImageToVideoPipeline`` folder. Configs follow
diffusers' own pipeline tests.
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


def tiny_wan_transformer(seed: int = 0, num_layers: int = 2, num_heads: int = 2, in_channels: int = 16,
                         image_dim: int | None = None):
    """``num_heads`` (2 as in diffusers' tests) must be divisible by a Ulysses degree (4 serves 2 and 4);
    image-to-video: ``in_channels=36`` (noise + mask + condition), Wan 2.1's ``image_dim``, with the image
    cross-attention projections (``added_kv_proj_dim``) a released Wan 2.1 I2V has (diffusers' test leaves them
    out, so its image tokens join the text ones)."""
    import torch
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=num_heads, attention_head_dim=12, in_channels=in_channels,
        out_channels=16, text_dim=32, freq_dim=256, ffn_dim=32, num_layers=num_layers, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=32, image_dim=image_dim,
        added_kv_proj_dim=None if image_dim is None else num_heads * 12)


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


def tiny_clip_image_encoder():
    """diffusers' test config (a 4-wide CLIP vision tower over 32x32 images) with 8x8 patches: 17 image tokens
    instead of its 1025, so tests stay fast."""
    import torch
    from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

    torch.manual_seed(0)
    return CLIPVisionModelWithProjection(CLIPVisionConfig(
        hidden_size=4, projection_dim=4, num_hidden_layers=2, num_attention_heads=2, image_size=32,
        intermediate_size=16, patch_size=8))


def clip_image_processor(**kwargs):
    """``CLIPImageProcessor`` when torchvision is installed, else its PIL twin (same preprocessing)."""
    import transformers

    try:
        import torchvision  # noqa: F401

        return transformers.CLIPImageProcessor(**kwargs)
    except ImportError:
        return transformers.CLIPImageProcessorPil(**kwargs)


def build_tiny_wan_i2v(path: str | os.PathLike, wan22: bool = False, expand_timesteps: bool = False,
                       boundary_ratio: float = 0.875, num_heads: int = 2) -> str:
    """Save a tiny random ``WanImageToVideoPipeline`` folder (diffusers' test configs); returns the folder.

    Default: Wan 2.1 I2V (CLIP ``image_encoder`` + ``image_processor``, a 36-channel transformer with
    ``image_dim``). ``wan22=True``: Wan 2.2 I2V-A14B (two 36-channel experts, ``boundary_ratio``, no image
    encoder). ``expand_timesteps=True``: Wan 2.2 TI2V-5B style (one 16-channel transformer, per-token
    timesteps). ``model_index.json`` names ``CLIPImageProcessor`` as released folders do, even where the PIL
    class was saved (no torchvision); transformers loads the PIL one there.
    """
    import json

    from diffusers import WanImageToVideoPipeline

    path = os.fspath(path)
    components = tiny_wan_components(two_experts=wan22, boundary_ratio=boundary_ratio, num_heads=num_heads)
    in_channels = 16 if expand_timesteps else 36
    components["transformer"] = tiny_wan_transformer(0, num_heads=num_heads, in_channels=in_channels,
                                                     image_dim=None if (wan22 or expand_timesteps) else 4)
    if wan22:
        components["transformer_2"] = tiny_wan_transformer(1, num_heads=num_heads, in_channels=in_channels)
    if expand_timesteps:
        components["expand_timesteps"] = True
    if not (wan22 or expand_timesteps):
        components["image_encoder"] = tiny_clip_image_encoder()
        components["image_processor"] = clip_image_processor(crop_size=32, size=32)
    WanImageToVideoPipeline(**components).save_pretrained(path, safe_serialization=True)
    index_path = os.path.join(path, "model_index.json")
    with open(index_path, encoding="utf-8") as f:
        index = json.load(f)
    if index.get("image_processor", [None, None])[1] == "CLIPImageProcessorPil":
        index["image_processor"][1] = "CLIPImageProcessor"
        with open(index_path, "w", encoding="utf-8") as f:
            json.dump(index, f, indent=2)
    return path

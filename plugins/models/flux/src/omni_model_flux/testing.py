"""Tiny random-weight FLUX.1 folders for tests and benchmarks (no download, tokenizers built offline).

``build_tiny_flux(path)`` writes a diffusers-format ``FluxPipeline`` folder that both Omni's ``FluxPipeline``
and diffusers' own ``DiffusionPipeline.from_pretrained`` load; ``guidance_embeds=True`` is FLUX.1-dev's layout
(guidance-distilled), False schnell's. Configs follow diffusers' own pipeline tests
(``tests/pipelines/flux/test_pipeline_flux.py``).
"""

from __future__ import annotations

import os
import string


def t5_tokenizer():
    """Unigram over single characters (no file fetched)."""
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [(c, -3.0) for c in string.ascii_letters + string.digits + string.punctuation]
    return T5Tokenizer(vocab=pieces, extra_ids=0)


def clip_tokenizer():
    """Byte-level BPE over the 256 byte symbols (with and without ``</w>``), no merges; 77 tokens as CLIP."""
    from tokenizers import pre_tokenizers
    from transformers import CLIPTokenizer

    a = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(a)} | {c + "</w>": len(a) + i for i, c in enumerate(a)}
    for t in ["<|startoftext|>", "<|endoftext|>"]:
        vocab[t] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)


def tiny_flux_components(guidance_embeds: bool = True, num_layers: int = 1, num_single_layers: int = 1,
                         num_heads: int = 2) -> dict:
    """diffusers' test components (2 heads of 16, joint/pooled dim 32, one block of each kind, a 1-channel
    VAE with one level: VAE factor 1, so a 16x16 image is 8x8 packed tokens). The plain random init needs no
    sharpening: the pooled CLIP vector modulates every block, so another prompt moves an 8x8 image by ~3
    levels of 255 and true CFG by ~13 (the parity tests' teeth check relies on it)."""
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    torch.manual_seed(0)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=num_layers, num_single_layers=num_single_layers,
        attention_head_dim=16, num_attention_heads=num_heads, joint_attention_dim=32, pooled_projection_dim=32,
        axes_dims_rope=[4, 4, 8], guidance_embeds=guidance_embeds)
    clip_tok = clip_tokenizer()
    torch.manual_seed(0)
    text_encoder = CLIPTextModel(CLIPTextConfig(
        bos_token_id=clip_tok.bos_token_id, eos_token_id=clip_tok.eos_token_id, pad_token_id=clip_tok.pad_token_id,
        hidden_size=32, intermediate_size=37, layer_norm_eps=1e-05, num_attention_heads=4, num_hidden_layers=5,
        vocab_size=len(clip_tok), hidden_act="gelu", projection_dim=32)).eval()
    torch.manual_seed(0)
    text_encoder_2 = T5EncoderModel(T5Config(
        vocab_size=128, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4, relative_attention_num_buckets=8,
        is_encoder_decoder=False)).eval()
    torch.manual_seed(0)
    vae = AutoencoderKL(sample_size=32, in_channels=3, out_channels=3, block_out_channels=(4,), layers_per_block=1,
                        latent_channels=1, norm_num_groups=1, use_quant_conv=False, use_post_quant_conv=False,
                        shift_factor=0.0609, scaling_factor=1.5035)
    return {"transformer": transformer, "vae": vae, "text_encoder": text_encoder, "tokenizer": clip_tok,
            "text_encoder_2": text_encoder_2, "tokenizer_2": t5_tokenizer(),
            "scheduler": FlowMatchEulerDiscreteScheduler(), "image_encoder": None, "feature_extractor": None}


def build_tiny_flux(path: str | os.PathLike, guidance_embeds: bool = True, num_layers: int = 1,
                    num_single_layers: int = 1, num_heads: int = 2) -> str:
    """Save a tiny random FLUX.1 pipeline (safetensors) into ``path``; returns the folder (``num_heads`` 4: room for
    tensor x Ulysses parallelism)."""
    from diffusers import FluxPipeline

    path = os.fspath(path)
    FluxPipeline(**tiny_flux_components(guidance_embeds, num_layers, num_single_layers, num_heads)).save_pretrained(
        path, safe_serialization=True)
    return path

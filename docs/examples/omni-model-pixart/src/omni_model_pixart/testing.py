"""A tiny random-weight PixArt-Sigma folder, built offline: what the example's tests (and yours) run on.

``build_tiny_pixart(path)`` writes a diffusers-format ``PixArtSigmaPipeline`` folder (safetensors) that both
this plugin and diffusers' own ``DiffusionPipeline.from_pretrained`` load. Nothing is downloaded: the T5
tokenizer is a Unigram over single characters built in code, and the configs follow diffusers' own PixArt
test (``get_dummy_components``) with two changes: 2 heads (so a Ulysses degree of 2 divides them) and a
two-level VAE (scale factor 2, so ``scaling_factor`` and the VAE factor really act).
"""

from __future__ import annotations

import os
import string


def t5_tokenizer():
    """Unigram over single characters (98 pieces, one token per character): no file fetched."""
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [(c, -3.0) for c in string.ascii_letters + string.digits + string.punctuation]
    return T5Tokenizer(vocab=pieces, extra_ids=0)


def tiny_pixart_components(num_layers: int = 2, num_heads: int = 2) -> dict:
    """The components, each built after ``torch.manual_seed(0)`` (the same folder on every build). The plain random
    init needs no sharpening: another prompt moves a 16x16 image by tens of levels of 255, so a parity test sees
    the text handling (masks, CFG). The DPM-Solver++ thresholds its clean estimates: a random noise predictor makes
    ``(x - sigma * eps) / alpha`` blow up where ``alpha`` is ~0.006 (final latents of magnitude ~600 without it,
    where float32's last bit is ~6e-5); with it the latents stay in [-1, 1], as a trained model's do."""
    import torch
    from diffusers import AutoencoderKL, DPMSolverMultistepScheduler, PixArtTransformer2DModel
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(0)
    transformer = PixArtTransformer2DModel(
        sample_size=8, num_layers=num_layers, patch_size=2, attention_head_dim=8, num_attention_heads=num_heads,
        caption_channels=32, in_channels=4, cross_attention_dim=8 * num_heads, out_channels=8, attention_bias=True,
        activation_fn="gelu-approximate", num_embeds_ada_norm=1000, norm_type="ada_norm_single",
        norm_elementwise_affine=False, norm_eps=1e-6)
    torch.manual_seed(0)
    vae = AutoencoderKL(sample_size=32, in_channels=3, out_channels=3, block_out_channels=(4, 8), layers_per_block=1,
                        latent_channels=4, norm_num_groups=2, down_block_types=["DownEncoderBlock2D"] * 2,
                        up_block_types=["UpDecoderBlock2D"] * 2, scaling_factor=0.13025)
    torch.manual_seed(0)
    text_encoder = T5EncoderModel(T5Config(
        vocab_size=128, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4, relative_attention_num_buckets=8,
        is_encoder_decoder=False)).eval()
    return {"transformer": transformer, "vae": vae, "text_encoder": text_encoder, "tokenizer": t5_tokenizer(),
            "scheduler": DPMSolverMultistepScheduler(thresholding=True)}


def build_tiny_pixart(path: str | os.PathLike, num_layers: int = 2, num_heads: int = 2) -> str:
    """Save a tiny random PixArt-Sigma pipeline into ``path``; returns the folder."""
    from diffusers import PixArtSigmaPipeline

    path = os.fspath(path)
    PixArtSigmaPipeline(**tiny_pixart_components(num_layers, num_heads)).save_pretrained(
        path, safe_serialization=True)
    return path

"""Tiny random-weight HunyuanVideo 1.5 folders for tests and benchmarks (no download, tokenizers built offline).

``build_tiny_hunyuan_video15(path)`` writes a diffusers-format ``HunyuanVideo15Pipeline`` folder (text-to-video);
``build_tiny_hunyuan_video15(path, i2v=True)`` a ``HunyuanVideo15ImageToVideoPipeline`` one (a SigLIP vision tower
and its processor added). Both text encoders are real transformers classes with tiny configs: Qwen2.5-VL's text
model (byte-level tokenizer with a ChatML template) and a ByT5 encoder (``ByT5Tokenizer`` needs no files).
diffusers and transformers are imported only when called.
"""

from __future__ import annotations

import os

#: Ulysses-2 / TP-2 divide the head count; rope axes sum to the head dim
NUM_HEADS, HEAD_DIM = 2, 8
QWEN_DIM, BYT5_DIM, SIGLIP_DIM = 16, 16, 16
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def qwen_tokenizer():
    """Byte-level BPE over the 256 byte symbols plus the ChatML specials, with a ChatML chat template (the
    pipeline formats the system message and the prompt with ``apply_chat_template``); nothing fetched."""
    from tokenizers import AddedToken, pre_tokenizers
    from transformers import Qwen2Tokenizer

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for t in specials:
        vocab[t] = len(vocab)
    tok = Qwen2Tokenizer(vocab=vocab, merges=[])
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in specials], special_tokens=True)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_components(i2v: bool = False, num_layers: int = 2, sharpen: float = 4.0) -> dict:
    """The pipeline's components. ``sharpen`` scales the joint attention's QK-norm weights so that the prompt
    (and so text masks, CFG) moves the video by several levels of 255 (with the plain random init the video
    tokens attend almost uniformly, and a parity test could not see the text handling)."""
    import torch
    from diffusers import (AutoencoderKLHunyuanVideo15, ClassifierFreeGuidance, FlowMatchEulerDiscreteScheduler,
                           HunyuanVideo15Transformer3DModel)
    from transformers import ByT5Tokenizer, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel, T5Config, T5EncoderModel

    torch.manual_seed(0)
    transformer = HunyuanVideo15Transformer3DModel(
        in_channels=9, out_channels=4, num_attention_heads=NUM_HEADS, attention_head_dim=HEAD_DIM,
        num_layers=num_layers, num_refiner_layers=1, mlp_ratio=2.0, patch_size=1, patch_size_t=1,
        text_embed_dim=QWEN_DIM, text_embed_2_dim=BYT5_DIM, image_embed_dim=SIGLIP_DIM, rope_axes_dim=(2, 2, 4),
        target_size=32, task_type="i2v" if i2v else "t2v")
    with torch.no_grad():
        for block in transformer.transformer_blocks:
            for norm in (block.attn.norm_q, block.attn.norm_k, block.attn.norm_added_q, block.attn.norm_added_k):
                norm.weight.mul_(sharpen)
    torch.manual_seed(0)
    vae = AutoencoderKLHunyuanVideo15(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 8, 8),
                                      layers_per_block=1, spatial_compression_ratio=4, temporal_compression_ratio=4,
                                      scaling_factor=1.03682)
    torch.manual_seed(0)
    text_encoder = Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(
        hidden_size=QWEN_DIM, intermediate_size=16, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2,
        rope_theta=1e6, vocab_size=320, max_position_embeddings=2048,
        rope_scaling={"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"})).eval()
    torch.manual_seed(0)
    tokenizer_2 = ByT5Tokenizer()
    text_encoder_2 = T5EncoderModel(T5Config(
        vocab_size=len(tokenizer_2), d_model=BYT5_DIM, d_kv=8, d_ff=32, num_layers=2, num_heads=2,
        relative_attention_num_buckets=8, is_encoder_decoder=False)).eval()
    components = {"transformer": transformer, "vae": vae, "scheduler": FlowMatchEulerDiscreteScheduler(shift=5.0),
                  "text_encoder": text_encoder, "tokenizer": qwen_tokenizer(), "text_encoder_2": text_encoder_2,
                  "tokenizer_2": tokenizer_2, "guider": ClassifierFreeGuidance(guidance_scale=6.0)}
    if i2v:
        from transformers import SiglipImageProcessor, SiglipVisionConfig, SiglipVisionModel

        torch.manual_seed(0)
        components["image_encoder"] = SiglipVisionModel(SiglipVisionConfig(
            hidden_size=SIGLIP_DIM, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, image_size=32,
            patch_size=8)).eval()
        components["feature_extractor"] = SiglipImageProcessor(size={"height": 32, "width": 32})
    return components


def build_tiny_hunyuan_video15(path: str | os.PathLike, i2v: bool = False, **kwargs) -> str:
    """Save a tiny random HunyuanVideo 1.5 pipeline (safetensors) into ``path``; returns the folder."""
    from diffusers import HunyuanVideo15ImageToVideoPipeline, HunyuanVideo15Pipeline

    path = os.fspath(path)
    cls = HunyuanVideo15ImageToVideoPipeline if i2v else HunyuanVideo15Pipeline
    cls(**tiny_components(i2v, **kwargs)).save_pretrained(path, safe_serialization=True)
    return path

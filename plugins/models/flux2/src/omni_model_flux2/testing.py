"""Tiny random-weight FLUX.2 folders for tests and benchmarks (no download, tokenizers built offline).

``build_tiny_flux2_klein(path)`` writes a diffusers ``Flux2KleinPipeline`` folder (Qwen3 text encoder, CFG with
``guidance_scale``), ``build_tiny_flux2_dev(path)`` a ``Flux2Pipeline`` folder (Mistral3 text encoder behind a
Pixtral processor, embedded guidance). Both share the tiny ``Flux2Transformer2DModel`` and ``AutoencoderKLFlux2``.
The text encoders have as many layers as diffusers' default ``text_encoder_out_layers`` need (klein: 9/18/27,
dev: 10/20/30), so the pipelines run with their own defaults; at hidden size 8 they cost nothing.
"""

from __future__ import annotations

import os

#: chat templates of the tiny tokenizers: what diffusers' calls need (klein: ``enable_thinking`` is accepted;
#: dev: system + user messages whose content is a list of text parts)
QWEN3_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MISTRAL_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% for c in m['content'] %}{% if c['type'] == 'text' %}"
                    "{% if m['role'] == 'system' %}[SYSTEM_PROMPT]{{ c['text'] }}[/SYSTEM_PROMPT]"
                    "{% else %}[INST]{{ c['text'] }}[/INST]{% endif %}{% endif %}{% endfor %}{% endfor %}")


def _byte_vocab(specials: list[str]) -> dict:
    from tokenizers import pre_tokenizers

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for t in specials:
        vocab[t] = len(vocab)
    return vocab


def qwen3_tokenizer():
    """Byte-level BPE over the 256 byte symbols plus the ChatML specials; no merges, nothing fetched."""
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Qwen2Tokenizer(vocab=_byte_vocab(specials), merges=[])
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in specials], special_tokens=True)
    tok.pad_token = "<|endoftext|>"
    tok.chat_template = QWEN3_TEMPLATE
    return tok


def mistral_tokenizer():
    """A byte-level fast tokenizer with Mistral's specials and a text-only chat template. A released FLUX.2 [dev]
    folder holds a ``PixtralProcessor`` as ``tokenizer``; transformers builds that class only with torchvision
    (not installable beside this CPU torch), and diffusers' ``Flux2Pipeline`` calls nothing of it but
    ``apply_chat_template(conversations, tokenize=True, padding="max_length", ...)``, which a tokenizer answers the
    same way for text-only prompts."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[IMG]"]
    raw = Tokenizer(models.BPE(vocab=_byte_vocab(specials), merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                  pad_token="<pad>")
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in specials], special_tokens=True)
    # diffusers' long system message as one token, so a short max_sequence_length keeps the prompt
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

    tok.add_tokens([AddedToken(SYSTEM_MESSAGE, special=False, normalized=False)])
    tok.chat_template = MISTRAL_TEMPLATE
    return tok


def tiny_transformer(guidance_embeds: bool, joint_attention_dim: int, num_heads: int = 2, num_layers: int = 1,
                     num_single_layers: int = 1, sharpen: float = 4.0):
    """diffusers' test config of ``Flux2Transformer2DModel`` (heads of 16; 4 latent channels -> 16 packed).
    ``sharpen`` scales the text projection and the QK-norm weights: with the plain random init the image tokens
    attend almost uniformly and another prompt moves the tiny image by under one level of 255, so parity tests
    could not see text handling (CFG, padding, which prompt a row gets)."""
    import torch
    from diffusers import Flux2Transformer2DModel

    torch.manual_seed(0)
    model = Flux2Transformer2DModel(
        patch_size=1, in_channels=16, num_layers=num_layers, num_single_layers=num_single_layers,
        attention_head_dim=16, num_attention_heads=num_heads, joint_attention_dim=joint_attention_dim,
        timestep_guidance_channels=256, axes_dims_rope=[4, 4, 4, 4], guidance_embeds=guidance_embeds)
    with torch.no_grad():
        model.context_embedder.weight.mul_(sharpen)
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
                module.weight.mul_(sharpen)
    return model


def tiny_vae():
    """One level (VAE factor 1: a 16x16 image is 8x8 packed tokens after the 2x2 patchify), 4 latent channels,
    batch-norm statistics away from the identity so the (de)normalization is exercised."""
    import torch
    from diffusers import AutoencoderKLFlux2

    torch.manual_seed(0)
    vae = AutoencoderKLFlux2(sample_size=32, in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",),
                             up_block_types=("UpDecoderBlock2D",), block_out_channels=(4,), layers_per_block=1,
                             latent_channels=4, norm_num_groups=1, use_quant_conv=False, use_post_quant_conv=False)
    with torch.no_grad():
        vae.bn.running_mean.copy_(torch.linspace(-0.3, 0.3, vae.bn.running_mean.numel()))
        vae.bn.running_var.copy_(torch.linspace(0.5, 1.5, vae.bn.running_var.numel()))
    return vae.eval()


def tiny_klein_components(num_heads: int = 2, is_distilled: bool = False) -> dict:
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tok = qwen3_tokenizer()
    torch.manual_seed(0)
    text_encoder = Qwen3ForCausalLM(Qwen3Config(
        hidden_size=8, intermediate_size=16, num_hidden_layers=27, num_attention_heads=2, num_key_value_heads=1,
        head_dim=4, vocab_size=len(tok) + 8, max_position_embeddings=1024, pad_token_id=tok.pad_token_id)).eval()
    return {"transformer": tiny_transformer(False, 3 * 8, num_heads), "vae": tiny_vae(),
            "text_encoder": text_encoder, "tokenizer": tok,
            "scheduler": FlowMatchEulerDiscreteScheduler(), "is_distilled": is_distilled}


def tiny_dev_components(num_heads: int = 2) -> dict:
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    tok = mistral_tokenizer()
    vocab = len(tok) + 8
    torch.manual_seed(0)
    text_encoder = Mistral3ForConditionalGeneration(Mistral3Config(
        text_config={"model_type": "mistral", "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 30,
                     "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4, "vocab_size": vocab,
                     "max_position_embeddings": 2048, "pad_token_id": tok.pad_token_id},
        vision_config={"model_type": "pixtral", "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
                       "num_attention_heads": 2, "head_dim": 4, "image_size": 64, "patch_size": 16},
        image_token_index=tok.convert_tokens_to_ids("[IMG]"), spatial_merge_size=2,
        projector_hidden_act="gelu")).eval()
    return {"transformer": tiny_transformer(True, 3 * 8, num_heads), "vae": tiny_vae(),
            "text_encoder": text_encoder, "tokenizer": tok, "scheduler": FlowMatchEulerDiscreteScheduler()}


def build_tiny_flux2_klein(path: str | os.PathLike, num_heads: int = 2, is_distilled: bool = False) -> str:
    """Save a tiny random ``Flux2KleinPipeline`` (safetensors) into ``path``; returns the folder."""
    from diffusers import Flux2KleinPipeline

    path = os.fspath(path)
    Flux2KleinPipeline(**tiny_klein_components(num_heads, is_distilled)).save_pretrained(path, safe_serialization=True)
    return path


def build_tiny_flux2_dev(path: str | os.PathLike, num_heads: int = 2) -> str:
    """Save a tiny random ``Flux2Pipeline`` (FLUX.2 [dev] layout, safetensors) into ``path``; returns the folder."""
    from diffusers import Flux2Pipeline

    path = os.fspath(path)
    Flux2Pipeline(**tiny_dev_components(num_heads)).save_pretrained(path, safe_serialization=True)
    return path

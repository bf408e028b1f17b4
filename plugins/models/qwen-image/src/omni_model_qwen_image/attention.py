"""Qwen-Image's joint text+image attention routed through Omni's ``Attention`` layer.

The processor computes exactly what diffusers' ``QwenDoubleStreamAttnProcessor2_0`` computes (QKV of both
streams, QK RMS norms, RoPE, the [text, image] concatenation, the output projections) and hands only the
softmax(QK^T)V part to an :class:`omni_core.attention.Attention` layer with ``role="joint"`` (category
``"self"``), so the user's backend choice, sequence parallelism and attention-level hooks apply.
"""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_qwenimage import apply_rotary_emb_qwen

from omni_core.attention import Attention

ROLE = "joint"
ROLE_CATEGORY = "self"


class OmniQwenDoubleStreamAttnProcessor:
    """Drop-in for ``QwenDoubleStreamAttnProcessor2_0`` whose attention kernel is an Omni layer."""

    # read by diffusers' ``set_attention_backend`` / context-parallel plumbing; unused here
    _attention_backend = None
    _parallel_config = None

    def __init__(self, layer: Attention) -> None:
        self.layer = layer

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor = None,
                 encoder_hidden_states_mask: torch.Tensor = None, attention_mask: torch.Tensor | None = None,
                 image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if encoder_hidden_states is None:
            raise ValueError("Qwen-Image joint attention needs encoder_hidden_states (the text stream)")
        if attention_mask is not None:
            raise ValueError("Qwen-Image joint attention builds its mask from encoder_hidden_states_mask; "
                             "pass that instead of attention_mask")
        key_mask = None
        if encoder_hidden_states_mask is not None:  # [batch, txt] -> key padding over [text, image]
            image_mask = torch.ones(hidden_states.shape[:2], dtype=torch.bool, device=hidden_states.device)
            key_mask = torch.cat([encoder_hidden_states_mask.bool(), image_mask], dim=1)
        seq_txt = encoder_hidden_states.shape[1]
        head_dim = attn.inner_dim // attn.heads

        img_q = attn.to_q(hidden_states).unflatten(-1, (-1, head_dim))
        img_k = attn.to_k(hidden_states).unflatten(-1, (-1, head_dim))
        img_v = attn.to_v(hidden_states).unflatten(-1, (-1, head_dim))
        txt_q = attn.add_q_proj(encoder_hidden_states).unflatten(-1, (-1, head_dim))
        txt_k = attn.add_k_proj(encoder_hidden_states).unflatten(-1, (-1, head_dim))
        txt_v = attn.add_v_proj(encoder_hidden_states).unflatten(-1, (-1, head_dim))

        if attn.norm_q is not None:
            img_q = attn.norm_q(img_q)
        if attn.norm_k is not None:
            img_k = attn.norm_k(img_k)
        if attn.norm_added_q is not None:
            txt_q = attn.norm_added_q(txt_q)
        if attn.norm_added_k is not None:
            txt_k = attn.norm_added_k(txt_k)

        if image_rotary_emb is not None:
            img_freqs, txt_freqs = image_rotary_emb
            img_q = apply_rotary_emb_qwen(img_q, img_freqs, use_real=False)
            img_k = apply_rotary_emb_qwen(img_k, img_freqs, use_real=False)
            txt_q = apply_rotary_emb_qwen(txt_q, txt_freqs, use_real=False)
            txt_k = apply_rotary_emb_qwen(txt_k, txt_freqs, use_real=False)

        query = torch.cat([txt_q, img_q], dim=1)
        key = torch.cat([txt_k, img_k], dim=1)
        value = torch.cat([txt_v, img_v], dim=1)
        out = self.layer(query, key, value, attn_mask=key_mask).flatten(2, 3).to(query.dtype)

        txt_out, img_out = out[:, :seq_txt], out[:, seq_txt:]
        img_out = attn.to_out[0](img_out.contiguous())
        if len(attn.to_out) > 1:
            img_out = attn.to_out[1](img_out)
        txt_out = attn.to_add_out(txt_out.contiguous())
        return img_out, txt_out


def install_omni_attention(transformer: torch.nn.Module) -> list[Attention]:
    """Give every joint-attention module of ``transformer`` an Omni ``Attention`` layer (registered as the
    module's ``omni_attn`` child, so it shows in ``named_modules``) and a processor that calls it.

    Call inside :func:`omni_core.forward_context.use_config` so the layers pick the user's backends.
    """
    layers = []
    for name, module in transformer.named_modules():
        if not hasattr(module, "set_processor") or not hasattr(module, "add_q_proj"):
            continue
        head_dim = module.inner_dim // module.heads
        layer = Attention(module.heads, head_dim, role=ROLE, role_category=ROLE_CATEGORY, prefix=name)
        module.add_module("omni_attn", layer)
        module.set_processor(OmniQwenDoubleStreamAttnProcessor(layer))
        layers.append(layer)
    if not layers:
        raise ValueError(f"{type(transformer).__name__} has no joint attention modules to route through Omni")
    return layers

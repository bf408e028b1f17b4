"""FLUX's attention routed through Omni's ``Attention`` layer.

The processor computes exactly what diffusers' ``FluxAttnProcessor`` computes (QKV projections, QK RMS norms,
the [text, image] concatenation of the double-stream blocks, RoPE over the joint sequence, the output
projections) and hands only the softmax(QK^T)V part to an :class:`omni_core.attention.Attention` layer with
``role="joint"`` (category ``"self"``): the user's backend choice, sequence parallelism and attention-level
hooks apply. The single-stream blocks attend over the same ``[text; image]`` sequence (they concatenate it
themselves), so both block kinds use one processor and one role.
"""

from __future__ import annotations

import torch
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_flux import _get_qkv_projections

from omni_core.attention import Attention

ROLE = "joint"
ROLE_CATEGORY = "self"


class OmniFluxAttnProcessor:
    """Drop-in for ``FluxAttnProcessor`` whose attention kernel is an Omni layer."""

    # read by diffusers' ``set_attention_backend`` / context-parallel plumbing; unused here
    _attention_backend = None
    _parallel_config = None

    def __init__(self, layer: Attention) -> None:
        self.layer = layer

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None,
                 image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None):
        if attention_mask is not None:  # FLUX attends over its whole (padded) T5 sequence, as diffusers does
            raise ValueError("FLUX attention through Omni takes no attention_mask")
        query, key, value, enc_query, enc_key, enc_value = _get_qkv_projections(attn, hidden_states,
                                                                               encoder_hidden_states)
        query = attn.norm_q(query.unflatten(-1, (-1, attn.head_dim)))
        key = attn.norm_k(key.unflatten(-1, (-1, attn.head_dim)))
        value = value.unflatten(-1, (-1, attn.head_dim))
        if attn.added_kv_proj_dim is not None:  # double-stream block: text in front of the image tokens
            enc_query = attn.norm_added_q(enc_query.unflatten(-1, (-1, attn.head_dim)))
            enc_key = attn.norm_added_k(enc_key.unflatten(-1, (-1, attn.head_dim)))
            query = torch.cat([enc_query, query], dim=1)
            key = torch.cat([enc_key, key], dim=1)
            value = torch.cat([enc_value.unflatten(-1, (-1, attn.head_dim)), value], dim=1)
        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
            key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
        out = self.layer(query, key, value).flatten(2, 3).to(query.dtype)
        if encoder_hidden_states is None:
            return out
        txt_len = encoder_hidden_states.shape[1]
        txt_out, img_out = out[:, :txt_len], out[:, txt_len:]
        img_out = attn.to_out[1](attn.to_out[0](img_out.contiguous()))
        return img_out, attn.to_add_out(txt_out.contiguous())


def install_omni_attention(transformer: torch.nn.Module) -> list[Attention]:
    """Give every ``FluxAttention`` of ``transformer`` (double- and single-stream blocks) an Omni ``Attention``
    layer (registered as the module's ``omni_attn`` child, so it shows in ``named_modules``) and a processor
    that calls it. Call inside :func:`omni_core.forward_context.use_config` so the layers pick the user's
    backends."""
    from diffusers.models.transformers.transformer_flux import FluxAttention

    layers = []
    for name, module in transformer.named_modules():
        if not isinstance(module, FluxAttention):
            continue
        layer = Attention(module.heads, module.head_dim, role=ROLE, role_category=ROLE_CATEGORY, prefix=name)
        module.add_module("omni_attn", layer)
        module.set_processor(OmniFluxAttnProcessor(layer))
        layers.append(layer)
    if not layers:
        raise ValueError(f"{type(transformer).__name__} has no FluxAttention modules to route through Omni")
    return layers

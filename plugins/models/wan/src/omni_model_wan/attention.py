"""Wan's self- and cross-attention routed through Omni's ``Attention`` layer.

The processor computes exactly what diffusers' ``WanAttnProcessor`` computes (projections, the across-heads
QK RMS norm, RoPE, the image-context branch of I2V models, output projection) and hands the softmax(QK^T)V
part to :class:`omni_core.attention.Attention` layers: ``attn1`` has ``role="self"``, ``attn2``
``role="cross"`` (and ``"cross_image"``, category ``"cross"``, for an I2V model's image context).
"""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_wan import _get_added_kv_projections, _get_qkv_projections

from omni_core.attention import Attention
from omni_core.forward_context import forward_context

#: text context length of Wan's text encoder, as diffusers hard-codes it to split off I2V image tokens
TEXT_CONTEXT_LENGTH = 512


def _apply_rotary_emb(x: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos = freqs_cos[..., 0::2]
    sin = freqs_sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


class OmniWanAttnProcessor:
    """Drop-in for diffusers' ``WanAttnProcessor`` whose attention kernels are Omni layers.

    A cross-attention call reads an optional ``[batch, text_len]`` key-padding mask from
    ``forward_context().call.text_mask`` (the typed denoise-call context; the pipeline sets a mask when it
    batches requests whose ``max_sequence_length`` differs); diffusers passes none.
    """

    _attention_backend = None
    _parallel_config = None

    def __init__(self, layer: Attention, image_layer: Attention | None = None) -> None:
        self.layer = layer
        self.image_layer = image_layer

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None,
                 rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        is_cross = encoder_hidden_states is not None
        encoder_hidden_states_img = None
        if attn.add_k_proj is not None:
            image_context_length = encoder_hidden_states.shape[1] - TEXT_CONTEXT_LENGTH
            encoder_hidden_states_img = encoder_hidden_states[:, :image_context_length]
            encoder_hidden_states = encoder_hidden_states[:, image_context_length:]

        query, key, value = _get_qkv_projections(attn, hidden_states, encoder_hidden_states)
        query = attn.norm_q(query).unflatten(2, (attn.heads, -1))
        key = attn.norm_k(key).unflatten(2, (attn.heads, -1))
        value = value.unflatten(2, (attn.heads, -1))
        if rotary_emb is not None:
            query = _apply_rotary_emb(query, *rotary_emb)
            key = _apply_rotary_emb(key, *rotary_emb)

        hidden_states_img = None
        if encoder_hidden_states_img is not None:
            key_img, value_img = _get_added_kv_projections(attn, encoder_hidden_states_img)
            key_img = attn.norm_added_k(key_img).unflatten(2, (attn.heads, -1))
            value_img = value_img.unflatten(2, (attn.heads, -1))
            hidden_states_img = self.image_layer(query, key_img, value_img).flatten(2, 3).type_as(query)

        mask = attention_mask
        if mask is None and is_cross:
            call = forward_context().call
            mask = call.text_mask if call is not None else None
        hidden_states = self.layer(query, key, value, attn_mask=mask).flatten(2, 3).type_as(query)
        if hidden_states_img is not None:
            hidden_states = hidden_states + hidden_states_img
        hidden_states = attn.to_out[0](hidden_states)
        return attn.to_out[1](hidden_states)


def install_omni_attention(transformer: torch.nn.Module, prefix: str = "") -> list[Attention]:
    """Give every ``WanAttention`` of ``transformer`` Omni ``Attention`` layers (registered as the module's
    ``omni_attn`` / ``omni_attn_img`` children) and a processor that calls them.

    Call inside :func:`omni_core.forward_context.use_config` so the layers pick the user's backends.
    """
    layers = []
    for name, module in transformer.named_modules():
        if not (hasattr(module, "set_processor") and hasattr(module, "is_cross_attention")):
            continue
        head_dim = module.inner_dim // module.heads
        where = f"{prefix}{name}"
        role = "cross" if module.is_cross_attention else "self"
        layer = Attention(module.heads, head_dim, role=role, role_category=role, prefix=where)
        module.add_module("omni_attn", layer)
        layers.append(layer)
        image_layer = None
        if module.add_k_proj is not None:
            image_layer = Attention(module.heads, head_dim, role="cross_image", role_category="cross",
                                    prefix=f"{where}.image")
            module.add_module("omni_attn_img", image_layer)
            layers.append(image_layer)
        module.set_processor(OmniWanAttnProcessor(layer, image_layer))
    if not layers:
        raise ValueError(f"{type(transformer).__name__} has no Wan attention modules to route through Omni")
    return layers

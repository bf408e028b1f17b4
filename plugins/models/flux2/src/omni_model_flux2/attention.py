"""FLUX.2's attention routed through Omni's ``Attention`` layer.

Two processors compute exactly what diffusers' ``Flux2AttnProcessor`` (double-stream blocks: image and text
projections, QK RMS norms, the ``[text, image]`` concatenation, RoPE, the output projections) and
``Flux2ParallelSelfAttnProcessor`` (single-stream blocks: the fused QKV+MLP projection, the SwiGLU MLP, the fused
output projection) compute, and hand only softmax(QK^T)V to an :class:`omni_core.attention.Attention` layer with
``role="joint"`` (category ``"self"``): the user's backend choice, sequence parallelism and attention-level hooks
apply. Both attend over ``[text; image]`` with the text in front.
"""

from __future__ import annotations

import torch
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_flux2 import _get_qkv_projections

from omni_core.attention import Attention

ROLE = "joint"
ROLE_CATEGORY = "self"


class OmniFlux2AttnProcessor:
    """Drop-in for ``Flux2AttnProcessor`` (double-stream blocks) whose attention kernel is an Omni layer."""

    _attention_backend = None
    _parallel_config = None

    def __init__(self, layer: Attention) -> None:
        self.layer = layer

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, image_rotary_emb=None):
        if attention_mask is not None:  # FLUX.2 attends over its whole (padded) text, as diffusers does
            raise ValueError("FLUX.2 attention through Omni takes no attention_mask")
        query, key, value, enc_query, enc_key, enc_value = _get_qkv_projections(attn, hidden_states,
                                                                               encoder_hidden_states)
        query = attn.norm_q(query.unflatten(-1, (-1, attn.head_dim)))
        key = attn.norm_k(key.unflatten(-1, (-1, attn.head_dim)))
        value = value.unflatten(-1, (-1, attn.head_dim))
        if attn.added_kv_proj_dim is not None:
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
            return attn.to_out[1](attn.to_out[0](out))
        txt_len = encoder_hidden_states.shape[1]
        txt_out, img_out = out.split_with_sizes([txt_len, out.shape[1] - txt_len], dim=1)
        return attn.to_out[1](attn.to_out[0](img_out)), attn.to_add_out(txt_out)


class OmniFlux2ParallelSelfAttnProcessor:
    """Drop-in for ``Flux2ParallelSelfAttnProcessor`` (single-stream blocks) whose attention is an Omni layer."""

    _attention_backend = None
    _parallel_config = None

    def __init__(self, layer: Attention) -> None:
        self.layer = layer

    def __call__(self, attn, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 image_rotary_emb=None):
        if attention_mask is not None:
            raise ValueError("FLUX.2 attention through Omni takes no attention_mask")
        hidden_states = attn.to_qkv_mlp_proj(hidden_states)
        # [q | k | v | gate | up]: under tensor parallelism ``inner_dim`` is this rank's (the plan's ``heads``
        # entry) and the layer's output this rank's slice of every part, so the rest is the local MLP part
        qkv_dim = 3 * attn.inner_dim
        qkv, mlp = torch.split(hidden_states, [qkv_dim, hidden_states.shape[-1] - qkv_dim], dim=-1)
        query, key, value = qkv.chunk(3, dim=-1)
        query = attn.norm_q(query.unflatten(-1, (-1, attn.head_dim)))
        key = attn.norm_k(key.unflatten(-1, (-1, attn.head_dim)))
        value = value.unflatten(-1, (-1, attn.head_dim))
        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
            key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
        out = self.layer(query, key, value).flatten(2, 3).to(query.dtype)
        return attn.to_out(torch.cat([out, attn.mlp_act_fn(mlp)], dim=-1))


def install_omni_attention(transformer: torch.nn.Module) -> list[Attention]:
    """Give every ``Flux2Attention`` and ``Flux2ParallelSelfAttention`` of ``transformer`` an Omni ``Attention``
    layer (the module's ``omni_attn`` child) and a processor that calls it. Call inside
    :func:`omni_core.forward_context.use_config` so the layers pick the user's backends."""
    from diffusers.models.transformers.transformer_flux2 import Flux2Attention, Flux2ParallelSelfAttention

    layers = []
    for name, module in transformer.named_modules():
        if isinstance(module, Flux2Attention):
            processor = OmniFlux2AttnProcessor
        elif isinstance(module, Flux2ParallelSelfAttention):
            processor = OmniFlux2ParallelSelfAttnProcessor
        else:
            continue
        layer = Attention(module.heads, module.head_dim, role=ROLE, role_category=ROLE_CATEGORY, prefix=name)
        module.add_module("omni_attn", layer)
        module.set_processor(processor(layer))
        layers.append(layer)
    if not layers:
        raise ValueError(f"{type(transformer).__name__} has no FLUX.2 attention modules to route through Omni")
    return layers

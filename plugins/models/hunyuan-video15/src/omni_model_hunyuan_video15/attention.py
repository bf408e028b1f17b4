"""HunyuanVideo 1.5's attention routed through Omni's ``Attention`` layers.

Two kinds of attention live in diffusers' ``HunyuanVideo15Transformer3DModel``:

* the dual-stream blocks' joint attention (``HunyuanVideo15AttnProcessor2_0``): QKV of the video tokens and of the
  condition tokens (SigLIP image, ByT5 glyph text, Qwen2.5-VL text, reordered valid-first by the transformer's
  forward), per-head QK RMS norms, RoPE on the video tokens, one attention over ``[video; condition]`` (text at the
  BACK), the output projections. :class:`OmniJointAttnProcessor` computes exactly that and hands softmax(QK^T)V to an
  Omni layer (role ``"hunyuan_video15.joint"``, category ``"self"``).
  diffusers masks padded condition tokens as queries AND keys (``mask_i & mask_j``); Omni backends take a
  key-padding mask, so padded queries attend to the valid keys instead. Their outputs only ever feed padded
  condition tokens, which no valid token attends to, so every valid token (and the video) is the same.
* the text token refiner's self-attention (diffusers' ``Attention`` with ``AttnProcessor2_0``) over the Qwen text
  alone: :class:`OmniRefinerAttnProcessor`, role ``"hunyuan_video15.text_refiner"`` (category ``"self"``), built with
  ``skip_sequence_parallel=True`` (it runs on the whole text on every rank, inside the sharded forward).
"""

from __future__ import annotations

import torch
from diffusers.models.embeddings import apply_rotary_emb

from omni_core.attention import Attention
from omni_core.attention.parallel.region import set_joint_text

JOINT_ROLE = "hunyuan_video15.joint"
REFINER_ROLE = "hunyuan_video15.text_refiner"


class OmniJointAttnProcessor:
    """Drop-in for ``HunyuanVideo15AttnProcessor2_0`` whose attention kernel is an Omni layer."""

    # read by diffusers' ``set_attention_backend`` / context-parallel plumbing; unused here
    _attention_backend = None
    _parallel_config = None

    def __init__(self, layer: Attention) -> None:
        self.layer = layer

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None,
                 image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None):
        head_dim = attn.inner_dim // attn.heads
        query = attn.norm_q(attn.to_q(hidden_states).unflatten(-1, (-1, head_dim)))
        key = attn.norm_k(attn.to_k(hidden_states).unflatten(-1, (-1, head_dim)))
        value = attn.to_v(hidden_states).unflatten(-1, (-1, head_dim))
        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
            key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
        n_txt = 0
        if encoder_hidden_states is not None:
            n_txt = encoder_hidden_states.shape[1]
            enc_query = attn.add_q_proj(encoder_hidden_states).unflatten(-1, (-1, head_dim))
            enc_key = attn.add_k_proj(encoder_hidden_states).unflatten(-1, (-1, head_dim))
            enc_value = attn.add_v_proj(encoder_hidden_states).unflatten(-1, (-1, head_dim))
            if attn.norm_added_q is not None:
                enc_query = attn.norm_added_q(enc_query)
            if attn.norm_added_k is not None:
                enc_key = attn.norm_added_k(enc_key)
            query = torch.cat([query, enc_query], dim=1)
            key = torch.cat([key, enc_key], dim=1)
            value = torch.cat([value, enc_value], dim=1)
        key_mask = None
        if attention_mask is not None:  # [B, condition tokens] (diffusers pads it with True for the video in front)
            text_mask = attention_mask.bool()
            if not bool(text_mask.all()):
                video = torch.ones(hidden_states.shape[:2], dtype=torch.bool, device=hidden_states.device)
                key_mask = torch.cat([video, text_mask], dim=1)
        set_joint_text(n_txt, "back")  # sequence parallel: the condition tokens are whole on every rank, at the back
        out = self.layer(query, key, value, attn_mask=key_mask).flatten(2, 3).to(query.dtype)
        if encoder_hidden_states is None:
            return out, None
        out, enc_out = out[:, :-n_txt], out[:, -n_txt:]
        out = attn.to_out[1](attn.to_out[0](out.contiguous()))
        return out, attn.to_add_out(enc_out.contiguous())


class OmniRefinerAttnProcessor:
    """Drop-in for diffusers' ``AttnProcessor2_0`` on the token refiner's self-attention (no norms, no rope)."""

    _attention_backend = None
    _parallel_config = None

    def __init__(self, layer: Attention) -> None:
        self.layer = layer

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        head_dim = attn.inner_dim // attn.heads
        query = attn.to_q(hidden_states).unflatten(-1, (-1, head_dim))
        key = attn.to_k(hidden_states).unflatten(-1, (-1, head_dim))
        value = attn.to_v(hidden_states).unflatten(-1, (-1, head_dim))
        key_mask = None
        if attention_mask is not None:  # [B, 1, L, L] = valid_i & valid_j -> the key-padding mask valid_j
            key_mask = attention_mask.bool()[:, 0].any(dim=1)
            if bool(key_mask.all()):
                key_mask = None
        out = self.layer(query, key, value, attn_mask=key_mask).flatten(2, 3).to(query.dtype)
        return attn.to_out[1](attn.to_out[0](out))


def install_omni_attention(transformer: torch.nn.Module, prefix: str = "") -> list[Attention]:
    """Give every attention module of ``transformer`` (the blocks' joint attention and the token refiner's) an Omni
    ``Attention`` layer (its ``omni_attn`` child) and a processor that calls it. Call inside
    :func:`omni_core.forward_context.use_config` so the layers pick the user's backends."""
    from diffusers.models.attention_processor import Attention as DiffusersAttention

    layers = []
    for name, module in transformer.named_modules():
        if not isinstance(module, DiffusersAttention):
            continue
        for attr in ("spatial_norm", "group_norm"):
            if getattr(module, attr, None) is not None:
                raise ValueError(f"{name}: {attr} is not supported by the Omni HunyuanVideo 1.5 processor")
        head_dim = module.inner_dim // module.heads
        joint = module.added_kv_proj_dim is not None
        layer = Attention(module.heads, head_dim, role=JOINT_ROLE if joint else REFINER_ROLE, role_category="self",
                          prefix=f"{prefix}{name}", skip_sequence_parallel=not joint)
        module.add_module("omni_attn", layer)
        module.set_processor(OmniJointAttnProcessor(layer) if joint else OmniRefinerAttnProcessor(layer))
        layers.append(layer)
    if not layers:
        raise ValueError(f"{type(transformer).__name__} has no attention modules to route through Omni")
    return layers

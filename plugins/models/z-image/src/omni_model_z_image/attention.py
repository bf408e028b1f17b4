"""Z-Image's attention routed through Omni's ``Attention`` layer.

The processor computes exactly what diffusers' ``ZSingleStreamAttnProcessor`` computes (QKV projections, QK
RMS norms, complex RoPE, output projection) and hands only the softmax(QK^T)V part to an
:class:`omni_core.attention.Attention` layer, so the user's backend choice, sequence parallelism and
attention-level hooks apply. Roles, all of category ``"self"``:

* ``"joint"`` -- the main ``layers``: one sequence of image and text tokens (sharded under sequence
  parallelism);
* ``"image_refiner"`` / ``"text_refiner"`` -- the ``noise_refiner`` (image tokens alone) and the
  ``context_refiner`` (text tokens alone), which run before the unified sequence exists: every rank keeps
  them whole (``skip_sequence_parallel``).
"""

from __future__ import annotations

import torch

from omni_core.attention import Attention

ROLE_CATEGORY = "self"
#: block list of ``ZImageTransformer2DModel`` -> (role, skip_sequence_parallel)
ROLES = {"layers": ("joint", False), "noise_refiner": ("image_refiner", True),
         "context_refiner": ("text_refiner", True)}


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """diffusers' Z-Image RoPE: ``x`` ``[B, S, H, D]`` rotated by complex ``freqs_cis`` ``[B, S, D/2]``."""
    x_c = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(x_c * freqs_cis.unsqueeze(2)).flatten(3).type_as(x)


class OmniZImageAttnProcessor:
    """Drop-in for ``ZSingleStreamAttnProcessor`` whose attention kernel is an Omni layer. The block passes a
    ``[batch, seq]`` boolean key-padding mask (True = attend) or None, which goes to the layer as it is."""

    # read by diffusers' ``set_attention_backend`` / context-parallel plumbing; unused here
    _attention_backend = None
    _parallel_config = None

    def __init__(self, layer: Attention) -> None:
        self.layer = layer

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, freqs_cis: torch.Tensor | None = None) -> torch.Tensor:
        if encoder_hidden_states is not None:
            raise ValueError("Z-Image attention is single-stream: text and image tokens come in one sequence")
        query = attn.to_q(hidden_states).unflatten(-1, (attn.heads, -1))
        key = attn.to_k(hidden_states).unflatten(-1, (attn.heads, -1))
        value = attn.to_v(hidden_states).unflatten(-1, (attn.heads, -1))
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        if freqs_cis is not None:
            query = apply_rotary_emb(query, freqs_cis)
            key = apply_rotary_emb(key, freqs_cis)
        if attention_mask is not None and attention_mask.dtype != torch.bool:
            raise ValueError("Z-Image attention takes a boolean [batch, seq] key-padding mask")
        out = self.layer(query, key, value, attn_mask=attention_mask).flatten(2, 3).to(query.dtype)
        out = attn.to_out[0](out)
        if len(attn.to_out) > 1:  # dropout
            out = attn.to_out[1](out)
        return out


def install_omni_attention(transformer: torch.nn.Module) -> list[Attention]:
    """Give the attention of every block of ``transformer`` (refiners and main layers) an Omni ``Attention``
    layer (registered as the attention module's ``omni_attn`` child, so it shows in ``named_modules``) and a
    processor that calls it. Call inside :func:`omni_core.forward_context.use_config` so the layers pick the
    user's backends."""
    layers = []
    for attr, (role, skip_sp) in ROLES.items():
        for i, block in enumerate(getattr(transformer, attr, None) or []):
            attn = block.attention
            layer = Attention(attn.heads, attn.inner_dim // attn.heads, role=role, role_category=ROLE_CATEGORY,
                              prefix=f"{attr}.{i}.attention", skip_sequence_parallel=skip_sp)
            attn.add_module("omni_attn", layer)
            attn.set_processor(OmniZImageAttnProcessor(layer))
            layers.append(layer)
    if not layers:
        raise ValueError(f"{type(transformer).__name__} has no Z-Image attention blocks to route through Omni")
    return layers

"""PixArt's self- and cross-attention routed through Omni's ``Attention`` layer.

``PixArtTransformer2DModel``'s blocks are diffusers' ``BasicTransformerBlock``: ``attn1`` attends over the image
tokens, ``attn2`` from the image tokens to the T5 text. Both are diffusers ``Attention`` modules running
``AttnProcessor2_0``. The processor here computes what that one computes for PixArt's configuration (q/k/v
projections, output projection and dropout) and hands only softmax(QK^T)V to an
:class:`omni_core.attention.Attention` layer, so the user's backend choice (``per_role`` too), sequence
parallelism and attention-level hooks reach the model. Roles: ``"pixart.self"`` (category ``"self"``) and
``"pixart.cross"`` (category ``"cross"``: under sequence parallelism its queries are this rank's image tokens and
its keys the whole text, so it runs locally).

The text key-padding mask: the transformer turns the ``[batch, text]`` mask the pipeline passes into an
additive bias ``[batch, 1, text]`` (0 = attend, -10000 = padding) before the blocks; the processor turns it back
into the boolean ``[batch, text]`` key-padding mask every Omni backend takes. Masked keys get no weight either
way (``exp(-10000)`` is 0 in float32), so the result is diffusers' bit for bit.
"""

from __future__ import annotations

import torch

from omni_core.attention import Attention

#: block attribute -> (role, role category)
ROLES = {"attn1": ("pixart.self", "self"), "attn2": ("pixart.cross", "cross")}


def key_padding_mask(bias: torch.Tensor | None) -> torch.Tensor | None:
    """diffusers' additive text bias ``[batch, 1, keys]`` (0 keep, -10000 padding) -> a boolean ``[batch, keys]``
    mask (True = attend), or None when nothing is masked."""
    if bias is None:
        return None
    if bias.dtype == torch.bool:
        keep = bias
    else:
        keep = bias == 0
    keep = keep.reshape(keep.shape[0], keep.shape[-1]) if keep.dim() == 3 else keep
    return None if bool(keep.all()) else keep


class OmniPixArtAttnProcessor:
    """Drop-in for ``AttnProcessor2_0`` on PixArt's attention modules whose kernel is an Omni layer."""

    # read by diffusers' ``set_attention_backend`` / context-parallel plumbing; unused here
    _attention_backend = None
    _parallel_config = None

    def __init__(self, layer: Attention) -> None:
        self.layer = layer

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        residual = hidden_states
        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        query = attn.to_q(hidden_states).unflatten(-1, (attn.heads, -1))  # [B, S, H, D]: Omni's layout
        key = attn.to_k(context).unflatten(-1, (attn.heads, -1))
        value = attn.to_v(context).unflatten(-1, (attn.heads, -1))
        out = self.layer(query, key, value, attn_mask=key_padding_mask(attention_mask)).flatten(2).to(query.dtype)
        out = attn.to_out[1](attn.to_out[0](out))  # projection, dropout
        if attn.residual_connection:
            out = out + residual
        return out / attn.rescale_output_factor


def install_omni_attention(transformer: torch.nn.Module) -> list[Attention]:
    """Give ``attn1`` and ``attn2`` of every block of ``transformer`` an Omni ``Attention`` layer (registered as
    the attention module's ``omni_attn`` child, so it shows in ``named_modules`` and tensor parallelism finds it)
    and a processor that calls it; returns the layers. Called inside :func:`omni_core.forward_context.use_config`
    (``DiffusersStepPipeline.load`` does), so the layers pick the user's backends."""
    layers = []
    for i, block in enumerate(transformer.transformer_blocks):
        for attr, (role, category) in ROLES.items():
            attn = getattr(block, attr, None)
            if attn is None:
                continue
            unsupported = [name for name in ("spatial_norm", "group_norm", "norm_q", "norm_k", "norm_cross")
                           if getattr(attn, name, None)]
            if unsupported:  # not in any PixArt configuration: refuse rather than compute something else
                raise ValueError(f"transformer_blocks.{i}.{attr} uses {unsupported}, which the PixArt processor "
                                 "does not implement")
            layer = Attention(attn.heads, attn.inner_dim // attn.heads, role=role, role_category=category,
                              prefix=f"transformer_blocks.{i}.{attr}")
            attn.add_module("omni_attn", layer)
            attn.set_processor(OmniPixArtAttnProcessor(layer))
            layers.append(layer)
    if not layers:
        raise ValueError(f"{type(transformer).__name__} has no transformer_blocks to route through Omni")
    return layers

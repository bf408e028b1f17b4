"""Qwen-Image 2.1's attention routed through Omni's ``Attention`` layer, each row with its own cached prefix.

The processor computes what diffusers' ``QwenImage21AttnProcessor`` computes on a cached (decode) step: the
target tokens' QKV, QK RMS norms, RoPE, keys/values ``[cached prefix, target]``, the output projection; only
softmax(QK^T)V goes to an :class:`omni_core.attention.Attention` layer (``role="joint"``, category ``"self"``), so
the user's backend choice, sequence parallelism and attention-level hooks apply. The prefix comes per row: block
``i`` reads layer ``i`` of the ``prefix_kv`` the forward hands every block (``layer_cache``, see ``model.py``),
with the key-padding mask over ``[prefix, image]`` (``key_valid``).

Under sequence parallelism the prefix is the plan's joint text (replicated on every rank, in front): Omni's
strategies take a joint call as ``[text, image]`` queries and keys of equal length, so the processor puts ``P``
zero queries in front of this rank's image queries there and drops their outputs (``P / S`` extra attention
work, where ``S`` is the image token count); outside sequence parallelism the queries are the image tokens alone.
"""

from __future__ import annotations

import torch

from omni_core.attention import Attention
from omni_core.attention.parallel.region import current_region
from omni_model_qwen_image21.model import qkv

ROLE = "joint"
ROLE_CATEGORY = "self"


class OmniQwenImage21AttnProcessor:
    """Drop-in for ``QwenImage21AttnProcessor`` on the cached-prefix step, whose attention kernel is an Omni layer."""

    # read by diffusers' ``set_attention_backend`` / context-parallel plumbing; unused here
    _attention_backend = None
    _parallel_config = None

    def __init__(self, layer: Attention, index: int, num_layers: int) -> None:
        self.layer = layer
        self.index = index
        self.num_layers = num_layers

    def __call__(self, attn, hidden_states: torch.Tensor, attention_mask=None, rotary_emb: torch.Tensor | None = None,
                 layer_cache: torch.Tensor | None = None, kv_cache_mode: str | None = None, cache_write_slice=None,
                 segments=None, key_valid: torch.Tensor | None = None) -> torch.Tensor:
        if kv_cache_mode != "cached" or not torch.is_tensor(layer_cache) or attention_mask is not None or segments:
            raise ValueError("Omni's Qwen-Image 2.1 attention runs the cached-prefix step only (prefix_kv per row, "
                             "see omni_model_qwen_image21.model); the prefix itself is computed by prefix_kv()")
        head_dim = attn.inner_dim // attn.heads
        q, k, v = qkv(attn, hidden_states, rotary_emb, head_dim)
        heads = q.shape[2]
        prefix = layer_cache.unflatten(-1, (self.num_layers, 2, heads, head_dim))[:, :, self.index]
        prefix_len = prefix.shape[1]
        key = torch.cat([prefix[:, :, 0].to(k.dtype), k], dim=1)
        value = torch.cat([prefix[:, :, 1].to(v.dtype), v], dim=1)
        region = current_region()
        joint = region is not None and region.is_sharding and not self.layer.skip_sequence_parallel
        if joint:  # [text, image] queries, as the strategies take joint attention (module docstring)
            q = torch.cat([q.new_zeros(q.shape[0], prefix_len, *q.shape[2:]), q], dim=1)
        out = self.layer(q, key, value, attn_mask=key_valid)
        if joint:
            out = out[:, prefix_len:]
        out = out.flatten(2, 3).to(q.dtype)
        out = attn.to_out[0](out.contiguous())
        return attn.to_out[1](out)


def install_omni_attention(transformer: torch.nn.Module) -> list[Attention]:
    """Give every block's attention module an Omni ``Attention`` layer (its ``omni_attn`` child, so it shows in
    ``named_modules``) and a processor that calls it. Call inside :func:`omni_core.forward_context.use_config`
    so the layers pick the user's backends."""
    blocks = transformer.transformer_blocks
    layers = []
    for i, block in enumerate(blocks):
        module = block.attn
        layer = Attention(module.heads, module.inner_dim // module.heads, role=ROLE, role_category=ROLE_CATEGORY,
                          prefix=f"transformer_blocks.{i}.attn")
        module.add_module("omni_attn", layer)
        module.set_processor(OmniQwenImage21AttnProcessor(layer, i, len(blocks)))
        layers.append(layer)
    if not layers:
        raise ValueError(f"{type(transformer).__name__} has no attention modules to route through Omni")
    return layers

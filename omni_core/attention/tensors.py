"""Tensor helpers every attention kernel shares, so each applies the contract of
:mod:`omni_core.attention.backend` the same way: grouped-query head expansion and the two mask forms.

Masks (contract): a boolean key-padding mask ``[batch, seq_k]`` (True = attend), or a boolean/additive mask
broadcastable to ``[batch, heads, seq_q, seq_k]``. A kernel that takes only key padding asks
:func:`key_padding_mask`; one that takes dense masks (SDPA-like) asks :func:`dense_mask`.
"""

from __future__ import annotations

import torch


def expand_heads(x: torch.Tensor, num_heads: int, dim: int = 1) -> torch.Tensor:
    """``x`` with its heads (along ``dim``) repeated up to ``num_heads`` for grouped-query attention: query
    head ``h`` reads key/value head ``h // (num_heads // kv_heads)``, as ``repeat_interleave`` lays them out.
    Returned as it is when the counts already match."""
    kv_heads = x.shape[dim]
    if kv_heads == num_heads:
        return x
    if num_heads % kv_heads:
        raise ValueError(f"grouped-query attention needs query heads ({num_heads}) divisible by key/value heads "
                         f"({kv_heads})")
    return x.repeat_interleave(num_heads // kv_heads, dim=dim)


def expand_kv_heads(k: torch.Tensor, v: torch.Tensor, num_heads: int,
                    dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values expanded to ``num_heads`` heads (see :func:`expand_heads`)."""
    return expand_heads(k, num_heads, dim), expand_heads(v, num_heads, dim)


def key_padding_mask(attn_mask: torch.Tensor, batch: int, seq_k: int) -> torch.Tensor | None:
    """The boolean keep-mask ``[batch, seq_k]`` that ``attn_mask`` stands for, or None when it is not a
    key-padding mask (per query, per head or additive): the caller refuses that in its own words.

    ``[batch, 1, 1, seq_k]`` and a batch of one (broadcast) count as key padding; one of the wrong size is a
    ValueError.
    """
    mask = attn_mask
    if mask.dim() == 4 and mask.shape[1] == 1 and mask.shape[2] == 1:
        mask = mask[:, 0, 0, :]
    if mask.dim() != 2 or mask.dtype != torch.bool:
        return None
    if mask.shape[0] == 1 and batch > 1:
        mask = mask.expand(batch, -1)
    if tuple(mask.shape) != (batch, seq_k):
        raise ValueError(f"a key-padding mask must be [batch, seq_k] = [{batch}, {seq_k}], "
                         f"got {tuple(attn_mask.shape)}")
    return mask


def dense_mask(attn_mask: torch.Tensor | None, batch: int, seq_k: int) -> torch.Tensor | None:
    """``attn_mask`` as a 4-D mask that broadcasts to ``[batch, heads, seq_q, seq_k]`` (what SDPA takes): a
    ``[batch, seq_k]`` key-padding mask becomes ``[batch, 1, 1, seq_k]``; a 4-D mask passes as it is. A 2-D
    mask of another size, or any other rank, is a ValueError."""
    if attn_mask is None:
        return None
    if attn_mask.dim() == 2:
        if tuple(attn_mask.shape) != (batch, seq_k):
            raise ValueError(f"a 2-D attention mask must be a [batch, seq_k] = [{batch}, {seq_k}] key-padding mask, "
                             f"got {tuple(attn_mask.shape)}")
        return attn_mask[:, None, None, :]
    if attn_mask.dim() != 4:
        raise ValueError(f"attention mask must be [batch, seq_k] or 4-D broadcastable to [batch, heads, seq_q, seq_k]"
                         f", got {tuple(attn_mask.shape)}")
    return attn_mask

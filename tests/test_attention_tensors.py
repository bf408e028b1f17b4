"""``omni_core.attention.tensors``: grouped-query head expansion and the contract's mask forms, shared by every
kernel (the core's generic math, sequence parallelism, the reference backends and the kernel plugins)."""

from __future__ import annotations

import pytest
import torch

from omni_core.attention.tensors import dense_mask, expand_heads, expand_kv_heads, key_padding_mask


def test_query_head_h_reads_kv_head_h_over_the_group_size():
    k = torch.arange(2).float().view(1, 2, 1, 1).expand(1, 2, 3, 4)  # [batch, kv_heads, seq, dim]: head j == j
    v = k + 10
    ek, ev = expand_kv_heads(k, v, 6)
    assert ek[0, :, 0, 0].tolist() == [0, 0, 0, 1, 1, 1]
    assert ev[0, :, 0, 0].tolist() == [10, 10, 10, 11, 11, 11]
    assert torch.equal(ek, k.repeat_interleave(3, dim=1))


def test_other_head_dims_and_matching_counts():
    x = torch.randn(5, 2, 8)  # [seq, heads, dim], one sequence of flash's varlen layout
    assert expand_heads(x.transpose(0, 1), 4, dim=0).shape == (4, 5, 8)
    assert expand_heads(x, 2) is x


def test_heads_that_do_not_divide_are_refused():
    with pytest.raises(ValueError, match=r"query heads \(5\) divisible by key/value heads \(2\)"):
        expand_heads(torch.zeros(1, 2, 3, 4), 5)


def test_key_padding_mask_forms():
    keep = torch.tensor([[True, False, True], [True, True, False]])
    assert key_padding_mask(keep, 2, 3) is keep
    assert torch.equal(key_padding_mask(keep[:, None, None, :], 2, 3), keep)
    assert torch.equal(key_padding_mask(keep[:1], 2, 3), keep[:1].expand(2, 3))


@pytest.mark.parametrize("mask", [
    torch.zeros(2, 3),  # additive
    torch.ones(2, 1, 4, 3, dtype=torch.bool),  # per query
    torch.ones(2, 2, 1, 3, dtype=torch.bool),  # per head
    torch.ones(3, dtype=torch.bool),
], ids=["additive", "per-query", "per-head", "1-d"])
def test_masks_that_are_not_key_padding_give_none(mask):
    assert key_padding_mask(mask, 2, 3) is None


def test_key_padding_mask_of_the_wrong_size():
    with pytest.raises(ValueError, match=r"\[batch, seq_k\] = \[2, 3\], got \(2, 5\)"):
        key_padding_mask(torch.ones(2, 5, dtype=torch.bool), 2, 3)


def test_dense_mask_forms():
    keep = torch.ones(2, 3, dtype=torch.bool)
    assert dense_mask(None, 2, 3) is None
    assert dense_mask(keep, 2, 3).shape == (2, 1, 1, 3)
    additive = torch.zeros(1, 1, 4, 3)
    assert dense_mask(additive, 2, 3) is additive
    with pytest.raises(ValueError, match="2-D attention mask must be a"):
        dense_mask(torch.ones(1, 3, dtype=torch.bool), 2, 3)
    with pytest.raises(ValueError, match=r"4-D broadcastable to \[batch, heads, seq_q, seq_k\], got \(2, 4, 3\)"):
        dense_mask(torch.ones(2, 4, 3, dtype=torch.bool), 2, 3)

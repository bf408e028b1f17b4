"""Ring attention's log-sum-exp merge with blocks in which some rows see no key: flash-attn marks such a row
with lse = +inf (its output there may be 0 or NaN), torch math with -inf. Either way the block contributes
nothing to that row; a row with no key anywhere comes out 0 with lse -inf, and nothing is NaN."""

from __future__ import annotations

import pytest
import torch

from omni_core.attention.parallel import merge_partials


def _block(seed, batch=2, seq=5, heads=3, dim=4):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, seq, heads, dim, generator=g), torch.randn(batch, heads, seq, generator=g)


def _reference(parts):
    """The merge written out over the rows' visible blocks only."""
    outs = torch.stack([o for o, _ in parts])  # [n, B, L, H, D]
    lses = torch.stack([lse for _, lse in parts])  # [n, B, H, L]
    weights = torch.softmax(lses, dim=0).transpose(2, 3).unsqueeze(-1)
    return (outs * weights).sum(0), torch.logsumexp(lses, dim=0)


@pytest.mark.parametrize("marker", [float("inf"), float("-inf")], ids=["+inf (flash)", "-inf (math)"])
@pytest.mark.parametrize("garbage", [0.0, float("nan")], ids=["zeros", "nan"])
def test_a_block_without_keys_for_some_rows_contributes_nothing_to_them(marker, garbage):
    a, b, c = _block(0), _block(1), _block(2)
    out_b, lse_b = b[0].clone(), b[1].clone()
    lse_b[0, :, 1] = marker  # batch 0, query 1: no key in block b (all heads)
    lse_b[1, 2, 3] = marker  # batch 1, head 2, query 3
    out_b[0, 1] = garbage
    out_b[1, 3, 2] = garbage
    acc = None
    for part in (a, (out_b, lse_b), c):
        acc = merge_partials(acc, part)
    out, lse = acc
    assert not out.isnan().any() and not lse.isnan().any() and not lse.isinf().any()
    full_out, full_lse = _reference([a, b, c])
    without_out, without_lse = _reference([a, c])
    rows = [(0, slice(None), 1), (1, 2, 3)]  # (batch, head, query) of the rows block b cannot see
    for bi, h, qi in rows:
        torch.testing.assert_close(out[bi, qi, h], without_out[bi, qi, h])
        torch.testing.assert_close(lse[bi, h, qi], without_lse[bi, h, qi])
    keep = torch.ones_like(lse, dtype=torch.bool)
    keep[0, :, 1] = False
    keep[1, 2, 3] = False
    torch.testing.assert_close(lse[keep], full_lse[keep])
    torch.testing.assert_close(out.transpose(1, 2)[keep], full_out.transpose(1, 2)[keep])


@pytest.mark.parametrize("first_empty", [True, False])
def test_a_row_with_no_key_in_any_block_is_zero(first_empty):
    parts = [_block(3), _block(4)]
    for out, lse in parts:
        lse[1, 0, 2] = float("inf") if first_empty else float("-inf")
        out[1, 2, 0] = float("nan")
    acc = None
    for part in parts:
        acc = merge_partials(acc, part)
    out, lse = acc
    assert torch.equal(out[1, 2, 0], torch.zeros(4)) and lse[1, 0, 2] == float("-inf")
    assert not out.isnan().any()
    torch.testing.assert_close(out[0], _reference(parts)[0][0])


def test_a_single_block_with_empty_rows_is_cleaned_too():
    out, lse = _block(5)
    lse[0, 1, 1] = float("inf")
    out[0, 1, 1] = float("nan")
    merged_out, merged_lse = merge_partials(None, (out, lse))
    assert merged_lse[0, 1, 1] == float("-inf") and torch.equal(merged_out[0, 1, 1], torch.zeros(4))
    # one further block then gives that row exactly the other block's output
    other = _block(6)
    final_out, final_lse = merge_partials((merged_out, merged_lse), other)
    torch.testing.assert_close(final_out[0, 1, 1], other[0][0, 1, 1])
    assert final_lse[0, 1, 1] == other[1][0, 1, 1]

"""Plain-torch stand-ins for flash-attn 2's ``flash_attn_func`` and ``flash_attn_varlen_func``.

Same signatures, layouts, defaults and input checks as flash-attn 2.x (bottom-right aligned causal mask,
GQA head mapping, ``cu_seqlens`` int32, fp16/bf16 only, unit stride on head_dim), computed in float32 on
any device. The contract tests substitute them for the library so that the adapter's layout, scaling and
mask logic is checked on CPU; nothing at runtime uses them.
"""

from __future__ import annotations

import math

import torch

from omni_core.attention.tensors import expand_kv_heads

__version__ = "reference"


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, window_size, softcap: float,
           alibi_slopes, return_attn_probs: bool = False) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        assert t.dtype in (torch.float16, torch.bfloat16), f"FlashAttention only support fp16 and bf16 ({name})"
        assert t.stride(-1) == 1, f"Input tensor {name} must have contiguous last dimension"
    assert q.dtype == k.dtype == v.dtype, "query and key must have the same dtype"
    assert k.shape == v.shape, "k and v must have the same shape"
    assert q.shape[-1] == k.shape[-1] and q.shape[-1] <= 256, "FlashAttention supports head dimension at most 256"
    assert q.shape[-2] % k.shape[-2] == 0, "Number of heads in key/value must divide number of heads in query"
    if dropout_p or tuple(window_size) != (-1, -1) or softcap or alibi_slopes is not None:
        raise NotImplementedError("the reference implements dropout_p=0, no window, softcap or alibi only")


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: q ``[sq, h, d]``, k/v ``[sk, hk, d]`` -> out ``[sq, h, d]`` (q.dtype), lse ``[h, sq]``."""
    sq, heads, _ = q.shape
    sk = k.shape[0]
    qf = q.float().transpose(0, 1)  # [h, sq, d]
    kf, vf = expand_kv_heads(k.float().transpose(0, 1), v.float().transpose(0, 1), heads, dim=0)
    scores = qf @ kf.transpose(-1, -2) * scale
    if causal:  # bottom-right aligned: query i sees keys 0 .. i + sk - sq
        keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
        scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [h, sq]; -inf where a row sees no key
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)  # rows with no key -> zeros, as flash
    out = (probs @ vf).transpose(0, 1).to(q.dtype)
    return out, lse.masked_fill(torch.isneginf(lse), float("inf"))


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """q ``(batch, seqlen_q, nheads, headdim)``, k/v ``(batch, seqlen_k, nheads_k, headdim)`` -> out like q.

    With ``return_attn_probs``: ``(out, softmax_lse (batch, nheads, seqlen_q) float32, None)``.
    """
    _check(q, k, v, dropout_p, window_size, softcap, alibi_slopes)
    assert q.dim() == 4 and k.dim() == 4, "flash_attn_func takes (batch, seqlen, nheads, headdim) tensors"
    assert q.shape[0] == k.shape[0], "batch sizes of q and k differ"
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    outs, lses = zip(*(_attend(q[b], k[b], v[b], scale, causal) for b in range(q.shape[0])))
    out = torch.stack(outs)
    return (out, torch.stack(lses), None) if return_attn_probs else out


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """q ``(total_q, nheads, headdim)``, k/v ``(total_k, nheads_k, headdim)``; sequence ``i`` of q is
    ``q[cu_seqlens_q[i]:cu_seqlens_q[i+1]]`` -> out ``(total_q, nheads, headdim)``.

    With ``return_attn_probs``: ``(out, softmax_lse (nheads, total_q) float32, None)``.
    """
    _check(q, k, v, dropout_p, window_size, softcap, alibi_slopes)
    assert block_table is None, "the reference has no paged KV cache"
    assert q.dim() == 3 and k.dim() == 3, "flash_attn_varlen_func takes (total, nheads, headdim) tensors"
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        assert cu.dtype == torch.int32, f"{name} must have dtype int32"
        assert cu.dim() == 1 and cu.is_contiguous(), f"{name} must be a contiguous 1-D tensor"
    assert cu_seqlens_q.numel() == cu_seqlens_k.numel(), "cu_seqlens_q and cu_seqlens_k must have batch + 1 entries"
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    assert cq[-1] == q.shape[0] and ck[-1] == k.shape[0], "cu_seqlens must end at the total token count"
    assert max(b - a for a, b in zip(cq, cq[1:])) <= max_seqlen_q, "a q sequence is longer than max_seqlen_q"
    assert max(b - a for a, b in zip(ck, ck[1:])) <= max_seqlen_k, "a k sequence is longer than max_seqlen_k"
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    outs, lses = [], []
    for i in range(len(cq) - 1):
        o, lse = _attend(q[cq[i]:cq[i + 1]], k[ck[i]:ck[i + 1]], v[ck[i]:ck[i + 1]], scale, causal)
        outs.append(o)
        lses.append(lse)
    out = torch.cat(outs)
    return (out, torch.cat(lses, dim=1), None) if return_attn_probs else out

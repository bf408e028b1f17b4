"""A plain-torch stand-in for SageAttention 2's ``sageattn``.

Same signature, layouts (``"HND"``/``"NHD"``), defaults and input checks as ``sageattention.sageattn``
(fp16/bf16, unit stride on head_dim, head_dim <= 128, query heads divisible by kv heads, causal only for
``qo_len == kv_len``), computed exactly in float32 on any device (no quantization). The contract tests
substitute it for the library so that the adapter's layout and scaling are checked on CPU.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from omni_core.attention.tensors import expand_kv_heads


def sageattn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tensor_layout: str = "HND", is_causal: bool = False,
             sm_scale: float | None = None, return_lse: bool = False, **kwargs: Any):
    """q ``[batch, heads, qo_len, dim]`` ("HND") or ``[batch, qo_len, heads, dim]`` ("NHD"); k/v likewise.

    Returns the output in q's layout and dtype, plus the log-sum-exp ``[batch, heads, qo_len]`` (float32)
    with ``return_lse``.
    """
    assert tensor_layout in ("HND", "NHD"), f"Unsupported tensor layout: {tensor_layout}"
    assert q.dtype in (torch.float16, torch.bfloat16), "Input tensors must be torch.float16 or torch.bfloat16"
    assert q.dtype == k.dtype == v.dtype, "All tensors must have the same dtype."
    assert q.device == k.device == v.device, "All tensors must be on the same device."
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1, "Last dim of qkv must be contiguous."
    if q.shape[-1] > 128:
        raise ValueError(f"Unsupported head_dim: {q.shape[-1]}")
    if tensor_layout == "NHD":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    heads, kv_heads = q.shape[1], k.shape[1]
    assert heads % kv_heads == 0, "num_qo_heads must be divisible by num_kv_heads"
    qo_len, kv_len = q.shape[2], k.shape[2]
    if is_causal:
        assert qo_len == kv_len, "causal attention is only applicable when qo_len == kv_len"
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    kf, vf = expand_kv_heads(k.float(), v.float(), heads)
    scores = q.float() @ kf.transpose(-1, -2) * scale
    if is_causal:
        keep = torch.ones(qo_len, kv_len, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = (torch.softmax(scores, dim=-1) @ vf).to(q.dtype)
    if tensor_layout == "NHD":
        out = out.transpose(1, 2)
    return (out, lse) if return_lse else out

"""TORCH_SDPA's ``forward_with_lse`` (what Ring attention merges) on its CUDA path, run here with stand-ins for
torch's CUDA-only kernels that keep their schemas (``aten::_scaled_dot_product_flash_attention(query, key,
value, dropout_p, is_causal, return_debug_mask, *, scale)``, ``aten::_scaled_dot_product_efficient_attention
(query, key, value, attn_bias, compute_log_sumexp, dropout_p, is_causal, *, scale)``) and their rules (flash:
fp16/bf16, head dim <= 256 and a multiple of 8, no causal with seq_q != seq_k; efficient: lse padded to a
multiple of 32 rows). No call builds the float32 score matrix of the base class."""

from __future__ import annotations

import types

import pytest
import torch

import omni_attention_sdpa.backend as sdpa
from omni_core.attention.backend import AttentionImpl
from omni_core.testing import reference_attention
from omni_core.testing.attention import DEFAULT_TOLERANCES, reference_lse, ring_merge


def _exact(query, key, value, causal, scale):
    """[B, H, L, D] attention in float32, top-left causal (torch's semantics): (out, lse)."""
    scores = query.float() @ key.float().transpose(-1, -2) * scale
    if causal:
        keep = torch.ones(scores.shape[-2:], dtype=torch.bool).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    return (torch.softmax(scores, -1) @ value.float()).to(query.dtype), lse


def _common(query, key, value):
    assert query.dim() == key.dim() == value.dim() == 4, "query, key and value must be [B, H, L, D]"
    assert query.shape[1] == key.shape[1] == value.shape[1], "heads must match (kv is repeated before the call)"
    assert query.shape[-1] % 8 == 0, "head_size must be a multiple of 8 when called without SDPA's padding"


def make_cuda_stand_ins(calls: list):
    def flash(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
        _common(query, key, value)
        if query.dtype not in (torch.float16, torch.bfloat16):
            raise RuntimeError("FlashAttention only support fp16 and bf16 data type")
        if query.shape[-1] > 256 or (is_causal and query.shape[2] != key.shape[2]):
            raise RuntimeError("flash attention cannot run this call")
        calls.append("flash")
        out, lse = _exact(query, key, value, is_causal, scale)
        empty = torch.empty(0)
        return out, lse, empty, empty, query.shape[2], key.shape[2], empty, empty, empty

    def efficient(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *, scale=None):
        _common(query, key, value)
        assert attn_bias is None and compute_log_sumexp is True
        calls.append("efficient")
        out, lse = _exact(query, key, value, is_causal, scale)
        padded = torch.full((*lse.shape[:-1], -(-lse.shape[-1] // 32) * 32), float("nan"))
        padded[..., :lse.shape[-1]] = lse
        return out, padded, torch.empty(0), torch.empty(0)

    def can_use_flash_attention(params, debug=False):
        q, k = params.query, params.key
        return (q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256 and params.attn_mask is None
                and not (params.is_causal and q.shape[2] != k.shape[2]))

    def can_use_efficient_attention(params, debug=False):
        return params.query.dtype in (torch.float16, torch.bfloat16, torch.float32)

    aten = types.SimpleNamespace(_scaled_dot_product_flash_attention=flash,
                                 _scaled_dot_product_efficient_attention=efficient)
    checks = types.SimpleNamespace(SDPAParams=torch.backends.cuda.SDPAParams,
                                   can_use_flash_attention=can_use_flash_attention,
                                   can_use_efficient_attention=can_use_efficient_attention)
    return aten, checks


@pytest.fixture
def cuda_path(monkeypatch):
    """CPU tensors take the CUDA path, with the stand-ins; returns the list of kernels called."""
    calls = []
    aten, checks = make_cuda_stand_ins(calls)
    monkeypatch.setattr(sdpa, "aten", aten)
    monkeypatch.setattr(sdpa, "sdpa_checks", checks)
    monkeypatch.setitem(sdpa.LSE_KERNELS, "cpu", sdpa.cuda_attention_with_lse)
    return calls


def _qkv(dtype, seq_q=9, seq_k=9, heads=4, kv_heads=2, dim=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, seq_q, heads, dim, generator=g).to(dtype),
            torch.randn(2, seq_k, kv_heads, dim, generator=g).to(dtype),
            torch.randn(2, seq_k, kv_heads, dim, generator=g).to(dtype))


@pytest.mark.parametrize(("dtype", "causal", "seq_k", "kernel"), [
    ("bfloat16", False, 9, "flash"), ("float16", True, 9, "flash"), ("bfloat16", False, 40, "flash"),
    ("float32", False, 40, "efficient"), ("float32", True, 9, "efficient"),
    ("bfloat16", True, 5, "efficient"),  # flash refuses causal with seq_q != seq_k; efficient is top-left too
])
def test_cuda_path_takes_a_fused_kernel_and_its_lse(cuda_path, monkeypatch, dtype, causal, seq_k, kernel):
    monkeypatch.setattr(AttentionImpl, "forward_with_lse", lambda *a: pytest.fail("full score-matrix fallback"))
    q, k, v = _qkv(getattr(torch, dtype), seq_k=seq_k)
    impl = sdpa.TorchSDPAImpl(4, 32, 0.3, causal, 2)
    out, lse = impl.forward_with_lse(q, k, v)
    assert cuda_path == [kernel]
    atol, rtol = DEFAULT_TOLERANCES[dtype]
    torch.testing.assert_close(out.double(), reference_attention(q, k, v, causal=causal, scale=0.3), atol=atol,
                               rtol=rtol)
    assert lse.dtype == torch.float32 and tuple(lse.shape) == (2, 4, 9) and not lse.isnan().any()
    torch.testing.assert_close(lse.double(), reference_lse(q, k, causal=causal, scale=0.3), atol=1e-4, rtol=1e-4)


def test_head_dims_the_kernels_cannot_take_fall_back(cuda_path):
    q, k, v = _qkv(torch.float32, dim=20)
    out, lse = sdpa.TorchSDPAImpl(4, 20, 0.3, False, 2).forward_with_lse(q, k, v)
    assert cuda_path == []
    torch.testing.assert_close(out.double(), reference_attention(q, k, v, scale=0.3), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_ring_blocks_merge_within_the_contract_tolerance(cuda_path, dtype):
    q, k, v = _qkv(getattr(torch, dtype), seq_q=7, seq_k=45)
    out = ring_merge(sdpa.TorchSDPAImpl(4, 32, 32 ** -0.5, False, 2), q, k, v, blocks=4)
    assert len(cuda_path) == 4
    atol, rtol = DEFAULT_TOLERANCES[dtype]
    torch.testing.assert_close(out.double(), reference_attention(q, k, v, scale=32 ** -0.5), atol=atol, rtol=rtol)

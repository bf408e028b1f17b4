"""FLASH_ATTN: the adapter checked on CPU with a torch reference of flash-attn substituted for the library
(what is tested is the adapter's layout, scaling, GQA and mask logic), and the real kernels on a GPU."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest
import torch

import omni_attention_flash.backend as fb
from omni_attention_flash import reference
from omni_core.attention.backend import AttentionImpl
from omni_core.errors import ComponentUnavailableError, ConfigError
from omni_core.testing import AttentionBackendContract, reference_attention
from omni_core.testing.attention import reference_lse

REFERENCE_KERNELS = fb.FlashKernels.from_module("reference", reference)


class _FlashOverrides:
    """What FLASH_ATTN answers differently from a backend with full mask support."""

    backend_name = "FLASH_ATTN"

    @pytest.mark.parametrize("mask_kind", ["bool_per_batch", "bool_per_head", "additive"])
    def test_4d_mask(self, backend, mask_kind, dtype, device):
        """General masks are refused with a reason (flash has no dense-mask input); never ignored."""
        self.require(backend, dtype, device)
        shape = (2, 8, 24, 4, 4, 64)
        batch, seq_q, seq_k, heads = shape[:4]
        if mask_kind == "additive":
            mask = torch.zeros(batch, 1, seq_q, seq_k, dtype=getattr(torch, dtype))
        else:
            mask = torch.ones(batch, heads if mask_kind == "bool_per_head" else 1, seq_q, seq_k, dtype=torch.bool)
        q, k, v = self.inputs(shape, dtype, device)
        with pytest.raises(ComponentUnavailableError, match="key-padding mask"):
            self.run_layer(self.layer(shape).to(device), q, k, v, mask.to(device))


@pytest.fixture
def reference_flash(monkeypatch):
    """Substitute the torch reference for flash-attn and let the backend run on CPU, for one test."""
    monkeypatch.setattr(fb, "kernels_for", lambda device, version=None: REFERENCE_KERNELS)
    monkeypatch.setattr(fb.FlashAttentionBackend, "supported_devices", ("cpu", "cuda"))
    monkeypatch.setattr(fb.FlashAttentionBackend, "is_available", classmethod(lambda cls: (True, "")))
    return REFERENCE_KERNELS


class TestFlashContractOnReference(_FlashOverrides, AttentionBackendContract):
    """The shared contract, through the Attention layer, with the reference kernel on CPU."""

    devices = ("cpu",)
    kernel_fixture = "reference_flash"


@pytest.mark.gpu
class TestFlashContractOnGPU(_FlashOverrides, AttentionBackendContract):
    """The same contract on the real kernels (skipped with the reason where flash-attn or a GPU is missing)."""


# ---------------------------------------------------------------- adapter details, on the reference kernel
def _qkv(batch, seq_q, seq_k, heads, kv_heads, dim, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq_q, heads, dim, generator=g).to(dtype)
    k = torch.randn(batch, seq_k, kv_heads, dim, generator=g).to(dtype)
    v = torch.randn(batch, seq_k, kv_heads, dim, generator=g).to(dtype)
    return q, k, v


def _impl(heads, dim, *, kv_heads=None, causal=False, scale=None, **options):
    return fb.FlashAttentionImpl(heads, dim, scale if scale is not None else dim ** -0.5, causal, kv_heads, **options)


def _close(out, q, k, v, mask=None, *, causal=False, scale=None):
    ref = reference_attention(q, k, v, mask, causal=causal, scale=scale)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dim", [8, 40, 64, 128, 256])
def test_head_sizes_and_custom_scale(reference_flash, dim):
    q, k, v = _qkv(2, 5, 7, 4, 2, dim)
    out = _impl(4, dim, kv_heads=2, scale=0.3).forward(q, k, v)
    _close(out, q, k, v, scale=0.3)


def test_non_contiguous_inputs_are_made_contiguous(reference_flash):
    """Omni tensors often come from a transpose; the kernel (and the reference) need unit stride on head_dim."""
    q, k, v = _qkv(2, 6, 6, 4, 4, 32)
    qt, kt, vt = (t.transpose(-1, -2).contiguous().transpose(-1, -2) for t in (q, k, v))
    assert qt.stride(-1) != 1
    _close(_impl(4, 32).forward(qt, kt, vt), q, k, v)


@pytest.mark.parametrize("mask_shape", ["2d", "4d_broadcast", "batch_broadcast"])
def test_key_padding_mask_runs_varlen(monkeypatch, reference_flash, mask_shape):
    calls = []
    kernels = fb.FlashKernels("spy", reference.flash_attn_func,
                              lambda *a, **kw: calls.append((a, kw)) or reference.flash_attn_varlen_func(*a, **kw))
    monkeypatch.setattr(fb, "kernels_for", lambda device, version=None: kernels)
    q, k, v = _qkv(3, 5, 9, 4, 2, 64)
    keep = torch.tensor([[True] * 9, [True] * 4 + [False] * 5, [False, True] * 4 + [True]])
    if mask_shape == "batch_broadcast":
        keep = keep[1:2]
    mask = keep[:, None, None, :] if mask_shape == "4d_broadcast" else keep
    out = _impl(4, 64, kv_heads=2).forward(q, k, v, mask)
    _close(out, q, k, v, keep.expand(3, -1))
    ((q_arg, k_arg, _), kw), = calls
    cu_q, cu_k, max_q, max_k = (kw[n] for n in ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"))
    expect_lens = keep.expand(3, -1).sum(1)
    assert cu_q.tolist() == [0, 5, 10, 15] and max_q == 5
    assert cu_k.tolist() == [0, *expect_lens.cumsum(0).tolist()] and max_k == int(expect_lens.max())
    assert tuple(k_arg.shape) == (int(expect_lens.sum()), 2, 64)


def test_all_true_mask_takes_the_dense_kernel(monkeypatch, reference_flash):
    def no_varlen(*a, **kw):
        raise AssertionError("an all-True mask must not pay for unpadding")

    monkeypatch.setattr(fb, "kernels_for", lambda device, version=None: fb.FlashKernels(
        "dense-only", reference.flash_attn_func, no_varlen))
    q, k, v = _qkv(2, 4, 6, 2, 2, 16)
    _close(_impl(2, 16).forward(q, k, v, torch.ones(2, 6, dtype=torch.bool)), q, k, v)


def test_a_row_without_keys_gives_zeros(reference_flash):
    q, k, v = _qkv(2, 3, 4, 2, 2, 16)
    keep = torch.tensor([[True] * 4, [False] * 4])
    out = _impl(2, 16).forward(q, k, v, keep)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    _close(out[:1], q[:1], k[:1], v[:1])


def test_refusals_are_clear(reference_flash):
    q, k, v = _qkv(2, 4, 6, 2, 2, 16)
    with pytest.raises(ComponentUnavailableError, match="top-left"):
        _impl(2, 16, causal=True).forward(q, k, v)
    q2, k2, v2 = _qkv(2, 6, 6, 2, 2, 16)
    with pytest.raises(ValueError, match="either causal=True or an attention mask"):
        _impl(2, 16, causal=True).forward(q2, k2, v2, torch.ones(2, 6, dtype=torch.bool))
    with pytest.raises(ComponentUnavailableError, match="key-padding mask"):
        _impl(2, 16).forward(q, k, v, torch.zeros(2, 6))  # additive 2-D mask
    with pytest.raises(ValueError, match=r"\[batch, seq_k\] = \[2, 6\]"):
        _impl(2, 16).forward(q, k, v, torch.ones(2, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="one dtype"):
        _impl(2, 16).forward(q, k.half(), v)


def test_forward_with_lse_uses_the_kernel(monkeypatch, reference_flash):
    """Ring attention gets the kernel's log-sum-exp (FA2 returns (out, lse, S) with return_attn_probs)."""
    calls = []
    monkeypatch.setattr(fb, "kernels_for", lambda device, version=None: fb.FlashKernels(
        "spy", lambda *a, **kw: calls.append(kw) or reference.flash_attn_func(*a, **kw),
        reference.flash_attn_varlen_func, {"return_attn_probs": True}))
    q, k, v = _qkv(2, 7, 7, 4, 2, 32)
    for causal in (False, True):
        out, lse = _impl(4, 32, kv_heads=2, causal=causal).forward_with_lse(q, k, v)
        _close(out, q, k, v, causal=causal)
        assert lse.dtype == torch.float32 and tuple(lse.shape) == (2, 4, 7)
        torch.testing.assert_close(lse.double(), reference_lse(q, k, causal=causal, scale=32 ** -0.5),
                                   atol=1e-4, rtol=1e-4)
    assert all(kw.get("return_attn_probs") for kw in calls) and len(calls) == 2


def test_lse_keyword_follows_the_library_signature():
    def fa2(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, return_attn_probs=False): ...
    def aiter(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, return_lse=False, return_attn_probs=False): ...
    def fa3_early(q, k, v, softmax_scale=None, causal=False): ...

    def lse_kwargs(func):
        return fb.FlashKernels.from_module("x", types.SimpleNamespace(
            flash_attn_func=func, flash_attn_varlen_func=func)).lse_kwargs

    assert lse_kwargs(fa2) == {"return_attn_probs": True}
    assert lse_kwargs(aiter) == {"return_lse": True}
    assert lse_kwargs(fa3_early) == {}
    with pytest.raises(AttributeError):  # flash-attn 1.x has no flash_attn_func
        fb.FlashKernels.from_module("old", types.SimpleNamespace(flash_attn_unpadded_func=fa2))


def test_options_are_validated():
    assert _impl(2, 16, fa_version=2).fa_version == 2
    with pytest.raises(ConfigError, match="fa_version must be 2, 3"):
        _impl(2, 16, fa_version=4)
    with pytest.raises(ConfigError, match="unknown option.*window"):
        _impl(2, 16, window=3)
    with pytest.raises(ValueError, match="divisible"):
        _impl(6, 16, kv_heads=4)


# ---------------------------------------------------------------- availability here (no flash-attn, CPU torch)
def test_unavailable_here_says_why():
    if fb._module_present("flash_attn") or torch.cuda.is_available():
        pytest.skip("flash-attn or a GPU is present")
    ok, why = fb.FlashAttentionBackend.is_available()
    assert not ok and "flash_attn" in why and "omni-attention-flash[kernels]" in why
    with pytest.raises(ComponentUnavailableError, match="CUDA/ROCm devices only"):
        fb.kernels_for(torch.device("cpu"))


def test_selecting_it_here_is_a_clear_error(omni_plugin_manager):
    from omni_core.attention.selector import select_attention_backend
    from omni_core.config import AttentionConfig

    if fb.FlashAttentionBackend.is_available()[0]:
        pytest.skip("flash-attn is usable here")
    with pytest.raises(ComponentUnavailableError, match=r"'FLASH_ATTN'.*cannot run here: no flash attention"):
        select_attention_backend("self", head_size=64, attention_config=AttentionConfig(default="FLASH_ATTN"),
                                 pm=omni_plugin_manager)
    assert omni_plugin_manager.get_component("attention", "FLASH_ATTN").provider == "omni-attention-flash"


def test_entry_point_imports_no_torch():
    """Listing plugins stays cheap. (The backend imports without flash_attn: this file imports it.)"""
    code = "import sys, omni_attention_flash.hooks; assert 'torch' not in sys.modules, 'hooks imported torch'"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_impl_is_an_attention_impl():
    assert issubclass(fb.FlashAttentionBackend.get_impl_cls(), AttentionImpl)


# ---------------------------------------------------------------- the real kernel
@pytest.mark.gpu
def test_real_kernel_key_padding_and_causal():
    ok, why = fb.FlashAttentionBackend.is_available()
    if not ok:
        pytest.skip(why)
    q, k, v = (t.cuda() for t in _qkv(3, 33, 47, 8, 2, 128, torch.bfloat16))
    keep = torch.ones(3, 47, dtype=torch.bool)
    keep[1, 20:] = False
    keep[2, ::3] = False
    impl = _impl(8, 128, kv_heads=2)
    _close(impl.forward(q, k, v, keep.cuda()), q, k, v, keep)
    qs, ks, vs = (t.cuda() for t in _qkv(2, 40, 40, 4, 4, 64, torch.float16))
    _close(_impl(4, 64, causal=True).forward(qs, ks, vs), qs, ks, vs, causal=True)
    out, lse = _impl(4, 64).forward_with_lse(qs, ks, vs)
    torch.testing.assert_close(lse.double().cpu(), reference_lse(qs, ks, scale=64 ** -0.5), atol=1e-2, rtol=1e-2)

"""SAGE_ATTN: the adapter checked on CPU with a torch reference of ``sageattn`` substituted for the library
(what is tested is the adapter's layout, scaling, GQA and refusals), and the real kernel on a GPU."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import omni_attention_sage.backend as sb
from omni_attention_sage import reference
from omni_core.errors import ComponentUnavailableError, ConfigError
from omni_core.testing import AttentionBackendContract, reference_attention


@pytest.fixture
def reference_sage(monkeypatch):
    """Substitute the torch reference for sageattention and let the backend run on CPU, for one test."""
    calls = []

    def sageattn(*args, **kwargs):
        calls.append(kwargs)
        return reference.sageattn(*args, **kwargs)

    monkeypatch.setattr(sb, "sageattn_for", lambda device: sageattn)
    monkeypatch.setattr(sb.SageAttentionBackend, "supported_devices", ("cpu", "cuda"))
    monkeypatch.setattr(sb.SageAttentionBackend, "is_available", classmethod(lambda cls: (True, "")))
    return calls


class _SageContract(AttentionBackendContract):
    backend_name = "SAGE_ATTN"


class TestSageContractOnReference(_SageContract):
    """The shared contract, through the Attention layer, with the reference kernel on CPU."""

    devices = ("cpu",)
    kernel_fixture = "reference_sage"


@pytest.mark.gpu
class TestSageContractOnGPU(_SageContract):
    """The contract on the real kernel. SageAttention quantizes Q/K to INT8 (P/V to FP8 on sm89/sm90), so
    the tolerance is that of a quantized kernel, not of fp16 rounding."""

    tolerances = {"bfloat16": (1e-1, 1e-1), "float16": (1e-1, 1e-1)}


def _qkv(batch, seq_q, seq_k, heads, kv_heads, dim, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, seq_q, heads, dim, generator=g).to(dtype),
            torch.randn(batch, seq_k, kv_heads, dim, generator=g).to(dtype),
            torch.randn(batch, seq_k, kv_heads, dim, generator=g).to(dtype))


def _impl(heads, dim, *, kv_heads=None, causal=False, scale=None, **options):
    return sb.SageAttentionImpl(heads, dim, scale if scale is not None else dim ** -0.5, causal, kv_heads, **options)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dim", sb.SageAttentionBackend.supported_head_sizes)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_matches_sdpa(reference_sage, dim, dtype, causal):
    """Head sizes 64/96/128, GQA, causal, a non-default scale: NHD layout and sm_scale passed through."""
    q, k, v = _qkv(2, 9, 9, 6, 2, dim, dtype)
    out = _impl(6, dim, kv_heads=2, causal=causal, scale=0.2).forward(q, k, v)
    ref = reference_attention(q, k, v, causal=causal, scale=0.2)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
    assert reference_sage[-1] == {"tensor_layout": "NHD", "is_causal": causal, "sm_scale": 0.2}


def test_cross_attention_and_non_contiguous_inputs(reference_sage):
    q, k, v = _qkv(2, 5, 11, 4, 4, 64)
    qt, kt, vt = (t.transpose(-1, -2).contiguous().transpose(-1, -2) for t in (q, k, v))
    out = _impl(4, 64).forward(qt, kt, vt)
    torch.testing.assert_close(out.double(), reference_attention(q, k, v, scale=64 ** -0.5), atol=5e-3, rtol=5e-3)


def test_refusals_are_clear(reference_sage):
    q, k, v = _qkv(2, 4, 6, 2, 2, 64)
    with pytest.raises(ComponentUnavailableError, match="does not support attention masks"):
        _impl(2, 64).forward(q, k, v, torch.ones(2, 6, dtype=torch.bool))
    with pytest.raises(ComponentUnavailableError, match="seq_q == seq_k"):
        _impl(2, 64, causal=True).forward(q, k, v)
    with pytest.raises(ValueError, match="one dtype"):
        _impl(2, 64).forward(q, k.bfloat16(), v)
    with pytest.raises(ConfigError, match="takes no options"):
        _impl(2, 64, smooth_k=False)
    assert not reference_sage  # nothing reached the kernel


def test_layer_refuses_masks_and_other_head_sizes(omni_plugin_manager, reference_sage):
    from omni_core.attention.layer import Attention
    from omni_core.config import AttentionConfig

    cfg = AttentionConfig(default="SAGE_ATTN")
    with pytest.raises(ComponentUnavailableError, match="head size 80"):
        Attention(2, 80, attention_config=cfg)
    layer = Attention(2, 64, attention_config=cfg)
    q, k, v = _qkv(1, 3, 3, 2, 2, 64)
    with pytest.raises(ComponentUnavailableError, match="mask"):
        layer(q, k, v, attn_mask=torch.ones(1, 3, dtype=torch.bool))


# ---------------------------------------------------------------- availability
def test_unavailable_here_says_why():
    if sb._present():
        pytest.skip("sageattention is installed")
    ok, why = sb.SageAttentionBackend.is_available()
    assert not ok and "sageattention is not installed" in why and ">= 2" in why and "PyPI" in why
    with pytest.raises(ComponentUnavailableError, match="CUDA devices only"):
        sb.sageattn_for(torch.device("cpu"))


def test_pypi_1x_is_reported_as_too_old(monkeypatch):
    """PyPI's sageattention is 1.0.6 (Triton-only): the reason must name the version and where 2.x comes from."""
    monkeypatch.setattr(sb, "_present", lambda: True)
    monkeypatch.setattr(sb, "installed_version", lambda: "1.0.6")
    ok, why = sb.availability()
    assert not ok and "sageattention 1.0.6 is installed" in why and "needs >= 2" in why
    assert "github.com/thu-ml/SageAttention" in why
    monkeypatch.setattr(sb, "installed_version", lambda: "2.2.0+cu128torch2.8")
    if not torch.version.cuda:
        assert sb.availability() == (False, f"sageattention is installed but torch {torch.__version__} is built "
                                            f"without CUDA")


def test_entry_point_imports_no_torch():
    """Listing plugins stays cheap. (The backend imports without sageattention: this file imports it.)"""
    code = "import sys, omni_attention_sage.hooks; assert 'torch' not in sys.modules, 'hooks imported torch'"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.gpu
def test_real_kernel_gqa_and_causal():
    ok, why = sb.SageAttentionBackend.is_available()
    if not ok:
        pytest.skip(why)
    for causal in (False, True):
        q, k, v = (t.cuda() for t in _qkv(2, 256, 256, 8, 2, 128, torch.bfloat16))
        out = _impl(8, 128, kv_heads=2, causal=causal).forward(q, k, v)
        ref = reference_attention(q, k, v, causal=causal, scale=128 ** -0.5)
        torch.testing.assert_close(out.double().cpu(), ref, atol=1e-1, rtol=1e-1)

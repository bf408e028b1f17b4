"""SAGE_ATTN against a stand-in that keeps ``sageattention.sageattn``'s signature and its dispatch on the GPU
architecture (``core.py``: sm80, sm86, sm89, sm90, plus sm120 and sm121 from 2.2.0; ``ValueError("Unsupported CUDA
architecture: ...")`` anywhere else, at the first forward), and Ring attention through the kernel's own
log-sum-exp (``return_lse=True``)."""

from __future__ import annotations

import pytest
import torch

import omni_attention_sage.backend as sb
from omni_attention_sage import reference
from omni_core.attention.backend import AttentionImpl
from omni_core.errors import ComponentUnavailableError
from omni_core.testing import reference_attention
from omni_core.testing.attention import reference_lse, ring_merge

CAPABILITIES = [(7, 5), (8, 0), (8, 6), (8, 7), (8, 9), (9, 0), (10, 0), (12, 0), (12, 1)]


def stand_in(version: str, capability: tuple[int, int], calls: list | None = None):
    """``sageattn`` of ``version`` on a GPU of ``capability``: dispatches as the real one, computes exactly."""
    # main-branch core.py (2.2.0 since 6a64eb3): sm120 and sm121
    archs = {"sm80", "sm86", "sm89", "sm90"} | ({"sm120", "sm121"} if sb._version_tuple(version) >= (2, 2) else set())

    def sageattn(q, k, v, tensor_layout="HND", is_causal=False, sm_scale=None, return_lse=False, **kwargs):
        arch = f"sm{capability[0]}{capability[1]}"
        if arch not in archs:
            raise ValueError(f"Unsupported CUDA architecture: {arch}")
        if calls is not None:
            calls.append({"tensor_layout": tensor_layout, "is_causal": is_causal, "sm_scale": sm_scale,
                          "return_lse": return_lse, **kwargs})
        return reference.sageattn(q, k, v, tensor_layout, is_causal, sm_scale, return_lse)

    return sageattn


@pytest.fixture
def installed(monkeypatch):
    """``installed(version, capability)``: that sageattention on a CUDA torch, on a GPU of that capability."""
    def install(version: str, capability: tuple[int, int], calls: list | None = None):
        monkeypatch.setattr(sb, "_present", lambda: True)
        monkeypatch.setattr(sb, "installed_version", lambda: version)
        monkeypatch.setattr(torch.version, "cuda", "12.8")
        monkeypatch.setattr(sb, "_imported", {"sageattn": stand_in(version, capability, calls)})
        monkeypatch.setattr(sb, "_kernel_cache", {})
        monkeypatch.setattr(sb, "device_capability", lambda device: capability)
        monkeypatch.setattr(sb, "initialised_capability", lambda: None)

    return install


@pytest.mark.parametrize("version", ["2.0.1", "2.1.1", "2.2.0", "2.2.0.post3+cu128torch2.8"])
@pytest.mark.parametrize("capability", CAPABILITIES, ids=lambda c: f"sm{c[0]}{c[1]}")
def test_architecture_check_agrees_with_the_dispatch(installed, version, capability):
    """The backend refuses exactly the GPUs the installed sageattn would raise on, with a reason, before it."""
    installed(version, capability)
    q, k, v = (torch.randn(1, 4, 2, 64).half() for _ in range(3))
    try:
        stand_in(version, capability)(q, k, v, tensor_layout="NHD")
        dispatches = True
    except ValueError as exc:
        assert "Unsupported CUDA architecture" in str(exc)
        dispatches = False
    why = sb.SageAttentionBackend.check_capability(capability)
    assert (why is None) is dispatches
    if dispatches:
        assert callable(sb.sageattn_for(torch.device("cuda", 0)))
        return
    sm = f"sm{capability[0]}{capability[1]}"
    assert f"this GPU is {sm}" in why and "dispatches only sm80, sm86, sm89, sm90" in why
    if capability == (12, 0):
        assert "sm120 from 2.2.0: upgrade it" in why
    with pytest.raises(ComponentUnavailableError, match=f"{sm}.*Use TORCH_SDPA"):
        sb.sageattn_for(torch.device("cuda", 0))


def test_availability_includes_the_architecture_once_cuda_is_in_use(monkeypatch, installed):
    installed("2.1.1", (12, 0))
    assert sb.SageAttentionBackend.is_available() == (True, "")  # no CUDA in use here: not initialised for it
    monkeypatch.setattr(sb, "initialised_capability", lambda: (12, 0))
    ok, why = sb.SageAttentionBackend.is_available()
    assert not ok and "sageattention 2.1.1 dispatches only sm80, sm86, sm89, sm90; this GPU is sm120" in why
    monkeypatch.setattr(sb, "installed_version", lambda: "2.2.0")
    assert sb.SageAttentionBackend.is_available() == (True, "")


def test_forward_with_lse_is_the_kernels_own(monkeypatch):
    """Ring attention asks sageattn for its lse; the base class's float32 score matrix is never built."""
    calls = []
    monkeypatch.setattr(sb, "sageattn_for", lambda device: stand_in("2.2.0", (9, 0), calls))
    monkeypatch.setattr(AttentionImpl, "forward_with_lse", lambda *a: pytest.fail("full score-matrix fallback"))
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 9, 6, 64, generator=g).bfloat16()
    k, v = (torch.randn(2, 9, 2, 64, generator=g).bfloat16() for _ in range(2))
    for causal in (False, True):
        out, lse = sb.SageAttentionImpl(6, 64, 0.2, causal, 2).forward_with_lse(q, k, v)
        torch.testing.assert_close(out.double(), reference_attention(q, k, v, causal=causal, scale=0.2),
                                   atol=2e-2, rtol=2e-2)
        assert lse.dtype == torch.float32 and tuple(lse.shape) == (2, 6, 9)
        torch.testing.assert_close(lse.double(), reference_lse(q, k, causal=causal, scale=0.2), atol=1e-4, rtol=1e-4)
    assert [c["return_lse"] for c in calls] == [True, True] and all(c["tensor_layout"] == "NHD" for c in calls)
    # the blocks of a ring merge to full attention within the contract's bf16 tolerance
    q, k, v = q[:, :5], torch.randn(2, 31, 2, 64, generator=g).bfloat16(), torch.randn(2, 31, 2, 64, generator=g).bfloat16()
    out = ring_merge(sb.SageAttentionImpl(6, 64, 64 ** -0.5, False, 2), q, k, v, blocks=4)
    torch.testing.assert_close(out.double(), reference_attention(q, k, v, scale=64 ** -0.5), atol=2e-2, rtol=2e-2)

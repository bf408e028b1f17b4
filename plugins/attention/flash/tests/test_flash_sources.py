"""FLASH_ATTN against stand-ins that keep each real library's signature and architecture rule (read from the
sources: flash-attn 2.8 ``flash_attn_interface.py``, FA3 ``hopper/flash_attn_interface.py`` and its
``is_sm8x`` check (``major >= 8``; sm90 only before FA3 gained Ampere support), ROCm aiter ``aiter/ops/mha.py``). Each stand-in raises where the real function would:
a varlen argument in the wrong slot, or a GPU architecture its kernels are not built for."""

from __future__ import annotations

import types

import pytest
import torch

import omni_attention_flash.backend as fb
from omni_attention_flash import reference
from omni_core.errors import ComponentUnavailableError
from omni_core.testing import reference_attention

#: the architecture the fake kernels believe they run on (set per test)
GPU = {"capability": (9, 0)}


def _checked_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal):
    """What the C++ bindings enforce on the varlen arguments, then the torch reference."""
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not (isinstance(cu, torch.Tensor) and cu.dtype == torch.int32):
            raise TypeError(f"{name} must be an int32 tensor, got {type(cu).__name__}")
    for name, n in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(n, torch.Tensor) or not isinstance(n, int):
            raise TypeError(f"incompatible function arguments: {name} must be an int, got {type(n).__name__}")
    return reference.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                            softmax_scale=softmax_scale, causal=causal)


def _needs(arch_ok, message):
    if not arch_ok(GPU["capability"]):
        raise RuntimeError(message)


def fa2_module():
    """flash-attn 2.8: ``(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, ...)``."""
    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                        alibi_slopes=None, deterministic=False, return_attn_probs=False):
        _needs(lambda c: c >= (8, 0), "FlashAttention only supports Ampere GPUs or newer.")
        return reference.flash_attn_func(q, k, v, dropout_p, softmax_scale, causal,
                                         return_attn_probs=return_attn_probs)

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                               softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                               alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None):
        _needs(lambda c: c >= (8, 0), "FlashAttention only supports Ampere GPUs or newer.")
        return _checked_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                               causal)

    return types.SimpleNamespace(flash_attn_func=flash_attn_func, flash_attn_varlen_func=flash_attn_varlen_func,
                                 __version__="2.8.3")


def fa3_module():
    """FA3 (hopper): no ``dropout_p``; ``seqused_q/k`` after ``max_seqlen_k``; sm80+ (``hopper/flash_api.cpp``)."""
    hopper = (lambda c: c >= (8, 0), "FlashAttention only supports Ampere GPUs or newer.")

    def flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
                        v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1,
                        pack_gqa=None, deterministic=False, sm_margin=0, return_attn_probs=False):
        _needs(*hopper)
        out = reference.flash_attn_func(q, k, v, 0.0, softmax_scale, causal, return_attn_probs=return_attn_probs)
        return out[:2] if return_attn_probs else out  # FA3 returns (out, softmax_lse)

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None,
                               seqused_k=None, softmax_scale=None, causal=False, qv=None, q_descale=None,
                               k_descale=None, v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0,
                               num_splits=1, pack_gqa=None, deterministic=False, sm_margin=0,
                               return_attn_probs=False):
        _needs(*hopper)
        return _checked_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                               causal)

    return types.SimpleNamespace(flash_attn_func=flash_attn_func, flash_attn_varlen_func=flash_attn_varlen_func,
                                 __version__="3.0.0")


def aiter_module():
    """ROCm aiter: ``return_lse`` returns ``(out, lse)``; varlen ``(..., max_seqlen_k, min_seqlen_q, dropout_p)``."""
    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                        alibi_slopes=None, deterministic=True, return_lse=False, return_attn_probs=False):
        out = reference.flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, return_attn_probs=return_lse)
        return tuple(out[:2]) if return_lse else (out,)

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, min_seqlen_q=0,
                               dropout_p=0.0, softmax_scale=None, logits_soft_cap=0.0, causal=False,
                               window_size=(-1, -1), alibi_slopes=None, deterministic=False, return_lse=False,
                               return_attn_probs=False, block_table=None, out=None):
        if not isinstance(min_seqlen_q, int) or not isinstance(dropout_p, float):
            raise TypeError("min_seqlen_q must be an int and dropout_p a float")
        return (_checked_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                                causal),)

    return types.SimpleNamespace(flash_attn_func=flash_attn_func, flash_attn_varlen_func=flash_attn_varlen_func,
                                 __version__="0.1.5")


def reordered_module():
    """A flash-attn build whose varlen function takes ``max_seqlen_q`` before ``cu_seqlens_q`` (vllm's fork):
    only keyword arguments reach the right parameters."""
    fa2 = fa2_module()

    def flash_attn_varlen_func(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k=None,
                               seqused_k=None, softmax_scale=None, causal=False, dropout_p=0.0):
        return _checked_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                               causal)

    return types.SimpleNamespace(flash_attn_func=fa2.flash_attn_func, flash_attn_varlen_func=flash_attn_varlen_func,
                                 __version__="2.7.2.post1")


def _qkv(batch, seq_q, seq_k, heads, kv_heads, dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, seq_q, heads, dim, generator=g).bfloat16(),
            torch.randn(batch, seq_k, kv_heads, dim, generator=g).bfloat16(),
            torch.randn(batch, seq_k, kv_heads, dim, generator=g).bfloat16())


@pytest.mark.parametrize("make", [fa2_module, fa3_module, aiter_module, reordered_module],
                         ids=["flash-attn-2.8", "fa3", "aiter", "max_seqlen-first"])
def test_varlen_arguments_reach_every_signature(monkeypatch, make):
    """Key padding goes through ``flash_attn_varlen_func``; every source gets the right tensors and ints."""
    kernels = fb.FlashKernels.from_module(make.__name__, make())
    monkeypatch.setattr(fb, "kernels_for", lambda device, version=None: kernels)
    GPU["capability"] = (9, 0)
    q, k, v = _qkv(3, 5, 9, 4, 2, 64)
    keep = torch.tensor([[True] * 9, [True] * 4 + [False] * 5, [False, True] * 4 + [True]])
    out = fb.FlashAttentionImpl(4, 64, 64 ** -0.5, False, 2).forward(q, k, v, keep)
    torch.testing.assert_close(out.double(), reference_attention(q, k, v, keep), atol=2e-2, rtol=2e-2)
    lse_out, lse = fb.FlashAttentionImpl(4, 64, 64 ** -0.5, False, 2).forward_with_lse(q, k, v)
    assert tuple(lse.shape) == (3, 4, 5) and lse.dtype == torch.float32


# ---------------------------------------------------------------- which source for which GPU
@pytest.fixture
def installed(monkeypatch):
    """``installed(names)``: exactly these flash sources are installed (as the stand-ins above)."""
    modules = {"flash_attn": fa2_module(), "flash_attn_interface": fa3_module(), "aiter": aiter_module()}

    def install(*names):
        monkeypatch.setattr(fb, "_module_present", lambda name: name in names)
        monkeypatch.setattr(fb, "_imported", {n: modules[n] for n in names})
        monkeypatch.setattr(fb, "_kernel_cache", {})
        monkeypatch.setattr(torch.version, "hip", None)

    return install


def _pick(monkeypatch, capability, version=None):
    GPU["capability"] = capability
    monkeypatch.setattr(fb, "device_capability", lambda device: capability)
    monkeypatch.setattr(fb, "_kernel_cache", {})
    return fb.kernels_for(torch.device("cuda", 0), version)


@pytest.mark.parametrize(("capability", "label"), [((8, 0), "flash-attn 2.8.3"), ((8, 9), "flash-attn 2.8.3"),
                                                   ((9, 0), "FlashAttention-3 3.0.0")])
def test_fa3_on_hopper_and_fa2_elsewhere_when_both_are_installed(monkeypatch, installed, capability, label):
    installed("flash_attn", "flash_attn_interface")
    assert _pick(monkeypatch, capability).label == label
    assert fb.FlashAttentionBackend.check_capability(capability) is None


@pytest.mark.parametrize("capability", [(8, 0), (8, 6), (8, 9), (9, 0)])
def test_fa3_alone_runs_on_ampere_and_newer(monkeypatch, installed, capability):
    """Current FA3 accepts sm8x (``is_sm8x = major >= 8``): an FA3-only install is used on an A100 (issue #36)."""
    installed("flash_attn_interface")
    GPU["capability"] = capability
    fa3_module().flash_attn_func(*_qkv(1, 2, 2, 1, 1, 8))  # what a forward does: no error
    assert fb.FlashAttentionBackend.check_capability(capability) is None
    assert _pick(monkeypatch, capability).label == "FlashAttention-3 3.0.0"
    assert _pick(monkeypatch, capability, version=3).label == "FlashAttention-3 3.0.0"


def test_pre_ampere_gpus_are_refused_for_every_source(monkeypatch, installed):
    installed("flash_attn", "flash_attn_interface")
    with pytest.raises(RuntimeError, match="Ampere GPUs or newer"):  # what a forward would have hit
        GPU["capability"] = (7, 5)
        fa3_module().flash_attn_func(*_qkv(1, 2, 2, 1, 1, 8))
    with pytest.raises(ComponentUnavailableError, match=r"fa_version=3: .*FlashAttention-3 needs an Ampere or newer "
                                                         r"GPU \(compute capability >= 8.0\), this GPU is sm75"):
        _pick(monkeypatch, (7, 5), version=3)
    with pytest.raises(ComponentUnavailableError, match="Ampere or newer.*sm75"):
        _pick(monkeypatch, (7, 5))
    assert "sm75" in fb.FlashAttentionBackend.check_capability((7, 5))


def test_availability_includes_the_architecture_once_cuda_is_in_use(monkeypatch, installed):
    """In a process that already uses CUDA (a worker) is_available checks the current GPU; before that it
    does not initialise CUDA and only checks that a library imports."""
    installed("flash_attn_interface")
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(fb, "initialised_capability", lambda: None)
    assert fb.FlashAttentionBackend.is_available() == (True, "")
    monkeypatch.setattr(fb, "initialised_capability", lambda: (7, 5))
    ok, why = fb.FlashAttentionBackend.is_available()
    assert not ok and "Ampere or newer" in why and "sm75" in why
    monkeypatch.setattr(fb, "initialised_capability", lambda: (8, 0))
    assert fb.FlashAttentionBackend.is_available() == (True, "")
    monkeypatch.setattr(fb, "initialised_capability", lambda: (9, 0))
    assert fb.FlashAttentionBackend.is_available() == (True, "")


def test_rocm_hint_names_amd_aiter(monkeypatch, installed):
    """PyPI's ``aiter`` is an unrelated package; AMD's kernels are ``amd-aiter`` (import name ``aiter``)."""
    installed()
    ok, why = fb.FlashAttentionBackend.is_available()
    assert not ok and "pip install amd-aiter" in why and "'aiter' is unrelated" in why
    monkeypatch.setattr(torch.version, "hip", "6.4.1")
    monkeypatch.setattr(fb, "_module_present", lambda name: name == "aiter")
    monkeypatch.setattr(fb, "_imported", {"aiter": types.SimpleNamespace(__version__="0.0.3")})  # the other one
    ok, why = fb.FlashAttentionBackend.is_available()
    assert not ok and "not AMD's kernel library" in why and "pip install amd-aiter" in why
    monkeypatch.setattr(fb, "_imported", {"aiter": aiter_module()})
    assert fb.FlashAttentionBackend.is_available() == (True, "")
    assert _pick(monkeypatch, (9, 4)).label == "aiter 0.1.5"  # gfx942: ROCm builds check their own targets

"""The ``cuda`` platform: detection (substituted probes and the real one), no CUDA initialisation,
default attention per compute capability, resolution through the plugin manager."""

from __future__ import annotations

import subprocess
import sys

import pytest

import omni_platform_cuda.hooks as cuda_hooks
import omni_platform_cuda.platform as cp
from omni_core.errors import ComponentUnavailableError
from omni_core.platforms import PlatformResolutionError, resolve_platform
from omni_core.plugins.manager import OmniPluginManager, create_plugin_manager, set_plugin_manager

CUDA_BOX = cp.CudaProbe("2.8.0+cu128", "12.8", None, 2)


def fresh_pm(*plugins: tuple[object, str, str]) -> OmniPluginManager:
    """Built-ins plus exactly the given ``(module, entry point name, distribution)`` plugins."""
    pm = OmniPluginManager(strict=True)
    pm.load_builtins()
    for module, name, dist in plugins:
        pm.register_plugin(module, name, dist=dist)
    return pm


@pytest.mark.parametrize(("probe", "detected", "reason"), [
    (cp.CudaProbe(None, None, None, 0), False, "torch is not installed"),
    (cp.CudaProbe("2.8.0+cpu", None, None, 0), False, "torch 2.8.0+cpu is built without CUDA"),
    (cp.CudaProbe("2.8.0+rocm6.4", None, "6.4.1", 1), False, "is a ROCm build (HIP 6.4.1); the rocm platform"),
    (cp.CudaProbe("2.8.0+cu128", "12.8", None, 0), False, "sees no CUDA device"),
    (CUDA_BOX, True, "2 CUDA device(s), torch 2.8.0+cu128 (CUDA 12.8)"),
])
def test_detect(monkeypatch, probe, detected, reason):
    monkeypatch.setattr(cp, "probe", lambda: probe)
    ok, why = cp.detect()
    assert ok is detected and reason in why
    assert cp.CudaPlatform().is_available() == (ok, why)


def test_real_detection_here_says_why():
    import torch

    ok, why = cp.detect()
    if ok:
        pytest.skip(f"a CUDA device is present: {why}")
    assert why and ("without CUDA" in why or "no CUDA device" in why or "ROCm" in why)
    assert not torch.cuda.is_initialized()


def test_import_and_detection_create_no_cuda_context():
    """In a clean process (other tests may have used the GPU): importing, detecting, counting and resolving
    the platform through the entry points leave CUDA uninitialised; the entry point imports no torch."""
    code = """
import sys
import omni_platform_cuda.hooks
assert "torch" not in sys.modules, "the entry point imported torch"
import omni_platform_cuda.platform as cp
assert "torch" not in sys.modules, "the platform module imported torch"
print(cp.detect(), cp.CudaPlatform().device_count())
from omni_core.platforms import resolve_platform
resolve_platform()
import torch
assert not torch.cuda.is_initialized(), "detection initialised CUDA"
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(("cap", "flash_ok", "expected"), [
    ((7, 5), True, "TORCH_SDPA"),  # Turing: flash-attn 2 does not run
    ((8, 0), True, "FLASH_ATTN"),
    ((8, 6), True, "FLASH_ATTN"),
    ((8, 9), True, "FLASH_ATTN"),
    ((9, 0), True, "FLASH_ATTN"),
    ((10, 0), True, "TORCH_SDPA"),  # Blackwell: not in the validated range
    ((12, 0), True, "TORCH_SDPA"),
    ((8, 0), False, "TORCH_SDPA"),  # flash-attn missing (or refuses this head size / dtype)
    ((9, 0), False, "TORCH_SDPA"),
])
def test_default_attention_by_capability(monkeypatch, cap, flash_ok, expected):
    asked = []
    monkeypatch.setattr(cp, "capability", lambda device=None: cap)
    monkeypatch.setattr(cp, "flash_attention_usable",
                        lambda head_size, dtype, capability: asked.append((head_size, dtype, capability))
                        or (flash_ok, ""))
    assert cp.CudaPlatform().default_attention_backend(128, None) == expected
    assert asked in ([], [(128, "bfloat16", cap)])  # dtype None means the platform's default dtype


def test_flash_usability_asks_the_flash_plugin(monkeypatch):
    """The platform defers to FLASH_ATTN's own rules: installed and importable, head size, dtype."""
    fb = pytest.importorskip("omni_attention_flash.backend")
    import omni_attention_flash.hooks as flash_hooks

    previous = set_plugin_manager(fresh_pm((flash_hooks, "attention-flash", "omni-attention-flash")))
    try:
        if not fb.FlashAttentionBackend.is_available()[0]:
            ok, why = cp.flash_attention_usable(64, "bfloat16")
            assert not ok and "no flash attention library" in why
        monkeypatch.setattr(fb.FlashAttentionBackend, "is_available", classmethod(lambda cls: (True, "")))
        assert cp.flash_attention_usable(64, "bfloat16") == (True, "")
        assert cp.flash_attention_usable(128, "float16") == (True, "")
        ok, why = cp.flash_attention_usable(100, "bfloat16")
        assert not ok and "head size 100" in why
        ok, why = cp.flash_attention_usable(64, "float32")
        assert not ok and "float32" in why
        set_plugin_manager(fresh_pm())  # no flash plugin installed
        ok, why = cp.flash_attention_usable(64, "bfloat16")
        assert not ok and "omni-attention-flash" in why
    finally:
        set_plugin_manager(previous)


def test_platform_facts():
    p = cp.CudaPlatform()
    assert (p.name, p.device_type, p.dist_backend, p.default_dtype) == ("cuda", "cuda", "nccl", "bfloat16")


def test_registered_through_its_entry_point():
    pm = create_plugin_manager(load_entrypoints=True, strict=True)
    spec = pm.get_component("platform", "cuda")
    assert spec.provider == "omni-platform-cuda" and spec.detect == "omni_platform_cuda.platform:detect"
    assert spec.load() is cp.CudaPlatform


def test_the_only_detected_platform_wins(monkeypatch):
    monkeypatch.delenv("OMNI_PLATFORM", raising=False)
    monkeypatch.setattr(cp, "probe", lambda: CUDA_BOX)
    res = resolve_platform(fresh_pm((cuda_hooks, "platform-cuda", "omni-platform-cuda")))
    assert res.name == "cuda" and isinstance(res.platform, cp.CudaPlatform)
    assert "cuda (omni-platform-cuda): detected: 2 CUDA device(s)" in "\n".join(res.trace)


def test_two_detected_platforms_are_an_error_naming_both(monkeypatch):
    npu = pytest.importorskip("omni_platform_npu.platform")
    import omni_platform_npu.hooks as npu_hooks

    monkeypatch.delenv("OMNI_PLATFORM", raising=False)
    monkeypatch.setattr(cp, "probe", lambda: CUDA_BOX)
    monkeypatch.setattr(npu, "probe", lambda: npu.NpuProbe(True, ("/dev/davinci0",)))
    pm = fresh_pm((cuda_hooks, "platform-cuda", "omni-platform-cuda"),
                  (npu_hooks, "platform-npu", "omni-platform-npu"))
    with pytest.raises(PlatformResolutionError, match="several platforms detected") as info:
        resolve_platform(pm)
    assert "cuda (omni-platform-cuda)" in str(info.value) and "npu (omni-platform-npu)" in str(info.value)
    assert "OMNI_PLATFORM" in str(info.value)
    monkeypatch.setenv("OMNI_PLATFORM", "cuda")  # the way out the message names
    assert resolve_platform(pm).name == "cuda"


def test_requesting_cuda_here_is_a_clear_error(monkeypatch):
    if cp.detect()[0]:
        pytest.skip("a CUDA device is present")
    monkeypatch.setenv("OMNI_PLATFORM", "cuda")
    with pytest.raises(ComponentUnavailableError, match="platform 'cuda' was requested but cannot run here: torch"):
        resolve_platform(fresh_pm((cuda_hooks, "platform-cuda", "omni-platform-cuda")))


@pytest.mark.gpu
def test_device_methods_on_a_real_gpu():
    import torch

    if not cp.detect()[0]:
        pytest.skip(cp.detect()[1])
    p = cp.CudaPlatform()
    p.set_device(p.get_torch_device(0))
    before = p.memory_stats()
    x = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    p.synchronize()
    after = p.memory_stats()
    assert set(after) == {"allocated", "reserved", "total", "free"}
    assert after["allocated"] >= before["allocated"] + (64 << 20) and after["total"] > after["free"] > 0
    del x
    p.empty_cache()
    assert p.memory_stats()["reserved"] <= after["reserved"]
    assert p.default_attention_backend(128, torch.bfloat16) in ("FLASH_ATTN", "TORCH_SDPA")


# ---------------------------------------------------------------- the flash plugin's architecture rules
def _fa3_module():
    """A stand-in ``flash_attn_interface`` with FA3's signatures (no ``dropout_p``)."""
    import types

    def flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
                        v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1,
                        pack_gqa=None, deterministic=False, sm_margin=0, return_attn_probs=False): ...

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None,
                               seqused_k=None, softmax_scale=None, causal=False): ...

    return types.SimpleNamespace(flash_attn_func=flash_attn_func, flash_attn_varlen_func=flash_attn_varlen_func,
                                 __version__="3.0.0b1")


@pytest.mark.parametrize(("cap", "expected", "reason"), [
    ((8, 0), "TORCH_SDPA", "FlashAttention-3 runs on Hopper GPUs only (sm90), this GPU is sm80"),
    ((8, 9), "TORCH_SDPA", "this GPU is sm89"),
    ((9, 0), "FLASH_ATTN", ""),
])
def test_only_fa3_installed_is_the_default_on_hopper_only(monkeypatch, cap, expected, reason):
    """FA3 alone on an Ampere/Ada GPU would fail at its first forward ("FlashAttention-3 only supports Hopper
    GPUs"): the platform must not pick it there, and the flash plugin says why."""
    import torch

    fb = pytest.importorskip("omni_attention_flash.backend")
    import omni_attention_flash.hooks as flash_hooks

    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(fb, "_module_present", lambda name: name == "flash_attn_interface")
    monkeypatch.setattr(fb, "_imported", {"flash_attn_interface": _fa3_module()})
    monkeypatch.setattr(fb, "initialised_capability", lambda: None)
    monkeypatch.setattr(cp, "capability", lambda device=None: cap)
    previous = set_plugin_manager(fresh_pm((flash_hooks, "attention-flash", "omni-attention-flash")))
    try:
        assert fb.FlashAttentionBackend.is_available() == (True, "")  # installed and importable
        assert cp.CudaPlatform().default_attention_backend(128, torch.bfloat16) == expected
        ok, why = cp.flash_attention_usable(128, "bfloat16", cap)
        assert ok is (expected == "FLASH_ATTN") and reason in why
        if reason:
            assert "flash_attn is not installed" in why  # and which library would serve this GPU
    finally:
        set_plugin_manager(previous)

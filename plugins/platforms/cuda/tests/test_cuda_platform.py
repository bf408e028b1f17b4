"""The ``cuda`` platform: detection (substituted probes and the real one), no CUDA initialisation,
default attention per compute capability, resolution through the plugin manager."""

from __future__ import annotations

import subprocess
import sys

import pytest

import omni_platform_cuda.hooks as cuda_hooks
import omni_platform_cuda.platform as cp
from omni_core.testing import PlatformContract
from omni_core.plugins.manager import create_plugin_manager

CUDA_BOX = cp.CudaProbe("2.8.0+cu128", "12.8", None, 2)


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
    """The platform bounds where a fast kernel may be the default; the kernels' records pick it (stand-ins here:
    FLASH_ATTN's place is taken by a fast stand-in, TORCH_SDPA's by a portable one)."""
    from omni_core.testing.kernel_stand_ins import FAST, PORTABLE, stand_in_kernels

    monkeypatch.setattr(cp.CudaPlatform, "capability", lambda self, device=None: cap)
    with stand_in_kernels(fast_ok=flash_ok) as asked:
        chosen = cp.CudaPlatform().default_attention_backend(128, None)
    assert chosen == {"FLASH_ATTN": FAST, "TORCH_SDPA": PORTABLE}[expected]
    assert asked in ([], [(128, "bfloat16", cap)])  # dtype None means the platform's default dtype


def test_platform_facts():
    p = cp.CudaPlatform()
    assert (p.name, p.device_type, p.dist_backend, p.default_dtype) == ("cuda", "cuda", "nccl", "bfloat16")


def test_registered_through_its_entry_point():
    pm = create_plugin_manager(load_entrypoints=True, strict=True)
    spec = pm.get_component("platform", "cuda")
    assert spec.provider == "omni-platform-cuda" and spec.detect == "omni_platform_cuda.platform:detect"
    assert spec.load() is cp.CudaPlatform


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


class TestCudaContract(PlatformContract):
    platform_module, hooks_module = cp, cuda_hooks
    entry_point, dist = "platform-cuda", "omni-platform-cuda"
    platform_name, platform_class = "cuda", "CudaPlatform"
    detect_cases = [
        (cp.CudaProbe(None, None, None, 0), False, "torch is not installed"),
        (cp.CudaProbe("2.8.0+cpu", None, None, 0), False, "torch 2.8.0+cpu is built without CUDA"),
        (cp.CudaProbe("2.8.0+rocm6.4", None, "6.4.1", 1), False, "is a ROCm build (HIP 6.4.1); the rocm platform"),
        (cp.CudaProbe("2.8.0+cu128", "12.8", None, 0), False, "sees no CUDA device"),
        (CUDA_BOX, True, "2 CUDA device(s), torch 2.8.0+cu128 (CUDA 12.8)"),
    ]
    detected_probe = CUDA_BOX
    unavailable_words = "platform 'cuda' was requested but cannot run here: torch"
    detected_trace = "cuda (omni-platform-cuda): detected: 2 CUDA device(s)"

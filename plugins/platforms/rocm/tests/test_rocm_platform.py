"""The ``rocm`` platform: detection (substituted probes and the real one), no device initialisation,
default attention, resolution through the plugin manager."""

from __future__ import annotations

import subprocess
import sys

import pytest

import omni_platform_rocm.hooks as rocm_hooks
import omni_platform_rocm.platform as rp
from omni_core.testing import PlatformContract

ROCM_BOX = rp.RocmProbe("2.8.0+rocm6.4", "6.4.1", 8)


def test_real_detection_here_says_why():
    ok, why = rp.detect()
    if ok:
        pytest.skip(f"an AMD GPU is present: {why}")
    assert "not a ROCm build" in why or "no AMD GPU" in why


def test_import_and_detection_create_no_device_context():
    code = """
import sys
import omni_platform_rocm.hooks, omni_platform_rocm.platform as rp
assert "torch" not in sys.modules, "importing the plugin imported torch"
print(rp.detect())
import torch
assert not torch.cuda.is_initialized(), "detection initialised the device runtime"
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(("flash_ok", "expected"), [(True, "FLASH_ATTN"), (False, "TORCH_SDPA")])
def test_default_attention(monkeypatch, flash_ok, expected):
    """Any GPU: the fast kernel where its record's checks pass, else the portable one (stand-ins for both)."""
    from omni_core.testing.kernel_stand_ins import FAST, PORTABLE, stand_in_kernels

    with stand_in_kernels(fast_ok=flash_ok) as asked:
        chosen = rp.RocmPlatform().default_attention_backend(64, "float16")
    assert chosen == {"FLASH_ATTN": FAST, "TORCH_SDPA": PORTABLE}[expected]
    assert asked == ([(64, "float16", None)] if flash_ok else [])  # no capability asked on ROCm


def test_platform_facts():
    p = rp.RocmPlatform()
    assert (p.name, p.device_type, p.dist_backend, p.default_dtype) == ("rocm", "cuda", "nccl", "bfloat16")



class TestRocmContract(PlatformContract):
    platform_module, hooks_module = rp, rocm_hooks
    entry_point, dist = "platform-rocm", "omni-platform-rocm"
    platform_name, platform_class = "rocm", "RocmPlatform"
    detect_cases = [
        (rp.RocmProbe(None, None, 0), False, "torch is not installed"),
        (rp.RocmProbe("2.8.0+cu128", None, 0), False, "torch 2.8.0+cu128 is not a ROCm build"),
        (rp.RocmProbe("2.8.0+rocm6.4", "6.4.1", 0), False, "sees no AMD GPU"),
        (ROCM_BOX, True, "8 AMD GPU(s), torch 2.8.0+rocm6.4 (HIP 6.4.1)"),
    ]
    detected_probe = ROCM_BOX
    unavailable_words = "platform 'rocm' was requested but cannot run here"

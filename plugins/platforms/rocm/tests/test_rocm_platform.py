"""The ``rocm`` platform: detection (substituted probes and the real one), no device initialisation,
default attention, resolution through the plugin manager."""

from __future__ import annotations

import subprocess
import sys

import pytest

import omni_platform_rocm.hooks as rocm_hooks
import omni_platform_rocm.platform as rp
from omni_core.errors import ComponentUnavailableError
from omni_core.platforms import resolve_platform
from omni_core.plugins.manager import OmniPluginManager, create_plugin_manager

ROCM_BOX = rp.RocmProbe("2.8.0+rocm6.4", "6.4.1", 8)


def fresh_pm() -> OmniPluginManager:
    pm = OmniPluginManager(strict=True)
    pm.load_builtins()
    pm.register_plugin(rocm_hooks, "platform-rocm", dist="omni-platform-rocm")
    return pm


@pytest.mark.parametrize(("probe", "detected", "reason"), [
    (rp.RocmProbe(None, None, 0), False, "torch is not installed"),
    (rp.RocmProbe("2.8.0+cu128", None, 0), False, "torch 2.8.0+cu128 is not a ROCm build"),
    (rp.RocmProbe("2.8.0+rocm6.4", "6.4.1", 0), False, "sees no AMD GPU"),
    (ROCM_BOX, True, "8 AMD GPU(s), torch 2.8.0+rocm6.4 (HIP 6.4.1)"),
])
def test_detect(monkeypatch, probe, detected, reason):
    monkeypatch.setattr(rp, "probe", lambda: probe)
    ok, why = rp.detect()
    assert ok is detected and reason in why
    assert rp.RocmPlatform().is_available() == (ok, why)


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
    asked = []
    monkeypatch.setattr(rp.RocmPlatform, "flash_attention_usable",
                        lambda self, head_size, dtype, capability=None: asked.append((head_size, dtype))
                        or (flash_ok, ""))
    assert rp.RocmPlatform().default_attention_backend(64, "float16") == expected
    assert asked == [(64, "float16")]


def test_platform_facts():
    p = rp.RocmPlatform()
    assert (p.name, p.device_type, p.dist_backend, p.default_dtype) == ("rocm", "cuda", "nccl", "bfloat16")


def test_registered_through_its_entry_point():
    spec = create_plugin_manager(load_entrypoints=True, strict=True).get_component("platform", "rocm")
    assert spec.provider == "omni-platform-rocm" and spec.load() is rp.RocmPlatform


def test_the_only_detected_platform_wins(monkeypatch):
    monkeypatch.delenv("OMNI_PLATFORM", raising=False)
    monkeypatch.setattr(rp, "probe", lambda: ROCM_BOX)
    res = resolve_platform(fresh_pm())
    assert res.name == "rocm" and isinstance(res.platform, rp.RocmPlatform)


def test_requesting_rocm_here_is_a_clear_error(monkeypatch):
    if rp.detect()[0]:
        pytest.skip("an AMD GPU is present")
    monkeypatch.setenv("OMNI_PLATFORM", "rocm")
    with pytest.raises(ComponentUnavailableError, match="platform 'rocm' was requested but cannot run here"):
        resolve_platform(fresh_pm())

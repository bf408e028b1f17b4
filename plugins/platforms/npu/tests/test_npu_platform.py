"""The ``npu`` platform: detection without importing torch or torch_npu, hccl, SDPA default, resolution."""

from __future__ import annotations

import subprocess
import sys

import omni_platform_npu.hooks as npu_hooks
import omni_platform_npu.platform as npu
from omni_core.testing import PlatformContract


def test_probe_counts_device_nodes_only(monkeypatch, tmp_path):
    for name in ("davinci0", "davinci1", "davinci_manager", "devmm_svm"):
        (tmp_path / name).touch()
    monkeypatch.setattr(npu, "DEVICE_GLOB", str(tmp_path / "davinci[0-9]*"))
    p = npu.probe()
    assert [n.rsplit("/", 1)[1] for n in p.device_nodes] == ["davinci0", "davinci1"]


def test_detection_imports_nothing():
    """find_spec only: torch_npu (which patches torch on import) and torch stay unimported."""
    code = """
import sys
import omni_platform_npu.hooks, omni_platform_npu.platform as npu
print(npu.detect())
assert "torch_npu" not in sys.modules and "torch" not in sys.modules, sorted(m for m in sys.modules if "torch" in m)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_platform_facts():
    p = npu.NpuPlatform()
    assert (p.name, p.device_type, p.dist_backend, p.default_dtype) == ("npu", "npu", "hccl", "bfloat16")

    from omni_core.testing.kernel_stand_ins import PORTABLE, stand_in_kernels

    with stand_in_kernels(fast_ok=True):  # a CUDA-only fast kernel is installed: not for the NPU
        assert p.default_attention_backend(128, "bfloat16") == PORTABLE



class TestNpuContract(PlatformContract):
    platform_module, hooks_module = npu, npu_hooks
    entry_point, dist = "platform-npu", "omni-platform-npu"
    platform_name, platform_class = "npu", "NpuPlatform"
    detect_cases = [
        (npu.NpuProbe(False, ()), False, "torch_npu (Ascend's PyTorch adapter) is not installed"),
        (npu.NpuProbe(True, ()), False, "torch_npu is installed but no Ascend device is present"),
        (npu.NpuProbe(True, ("/dev/davinci0", "/dev/davinci1")), True, "2 Ascend NPU(s) (/dev/davinci0, /dev/davinci1)"),
    ]
    detected_probe = npu.NpuProbe(True, ("/dev/davinci0",))
    unavailable_words = "platform 'npu' was requested but cannot run here: torch_npu"

"""The attention contract can fail: a backend that ignores masks, or mislabels what it supports, is caught."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

BACKENDS = '''
from omni_core.attention import AttentionBackend
from omni_attention_sdpa.backend import TorchSDPAImpl


class IgnoresMaskImpl(TorchSDPAImpl):
    def forward(self, query, key, value, attn_mask=None):
        return super().forward(query, key, value, None)  # silently drops the mask: must be caught


class IgnoresMask(AttentionBackend):
    name = "IGNORES_MASK"
    supported_devices = ("cpu",)

    @classmethod
    def get_impl_cls(cls):
        return IgnoresMaskImpl


class Float32Only(AttentionBackend):
    """Declares float32 only: other dtypes must be refused by the layer, and the contract checks that."""
    name = "FLOAT32_ONLY"
    supported_dtypes = ("float32",)
    supported_devices = ("cpu",)

    @classmethod
    def get_impl_cls(cls):
        return TorchSDPAImpl
'''

TESTS = '''
import pytest

from omni_core import hookimpl
from omni_core.plugins.types import AttentionBackendSpec
from omni_core.testing import AttentionBackendContract


class Plugin:
    @hookimpl
    def omni_register_attention_backends(self):
        return [AttentionBackendSpec(name="IGNORES_MASK", impl="contract_backends:IgnoresMask"),
                AttentionBackendSpec(name="FLOAT32_ONLY", impl="contract_backends:Float32Only")]


@pytest.fixture(autouse=True)
def _plugin(register_omni_plugin):
    register_omni_plugin(Plugin(), "contract-test", dist="omni-contract-test")


class TestIgnoresMask(AttentionBackendContract):
    backend_name = "IGNORES_MASK"
    dtypes = ("float32",)


class TestFloat32Only(AttentionBackendContract):
    backend_name = "FLOAT32_ONLY"
'''


@pytest.mark.slow
def test_contract_catches_a_backend_that_ignores_masks(tmp_path: Path, omni_env):
    (tmp_path / "contract_backends.py").write_text(textwrap.dedent(BACKENDS))
    (tmp_path / "test_contract_cases.py").write_text(textwrap.dedent(TESTS))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfs", "-p", "no:cacheprovider",
                           "--rootdir", str(tmp_path), str(tmp_path / "test_contract_cases.py")],
                          cwd=tmp_path, capture_output=True, text=True, env=omni_env({"PYTHONPATH": str(tmp_path)}),
                          timeout=300)
    out = proc.stdout
    failed = {line.split("::")[-2] + "::" + line.split("::")[-1].split(" ")[0]
              for line in out.splitlines() if line.startswith("FAILED")}
    # every mask check fails for the backend that drops masks, and nothing else does
    mask_tests = {t for t in failed if t.startswith("TestIgnoresMask::")}
    assert mask_tests and all("mask" in t for t in mask_tests), out[-3000:]
    assert {t.split("[")[0] for t in mask_tests} == {"TestIgnoresMask::test_key_padding_mask",
                                                     "TestIgnoresMask::test_4d_mask",
                                                     "TestIgnoresMask::test_bad_mask_shape_raises"}, out[-3000:]
    # the float32-only backend passes: its bf16/fp16 checks are skipped and refusing them is verified instead
    assert not any(t.startswith("TestFloat32Only") for t in failed), out[-3000:]
    assert "FLOAT32_ONLY does not declare dtype bfloat16" in out
    assert proc.returncode == 1

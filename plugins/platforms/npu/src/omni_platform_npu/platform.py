"""The ``npu`` platform: Huawei Ascend NPUs through ``torch_npu``.

Detection imports nothing: ``importlib.util.find_spec("torch_npu")`` (importing torch_npu patches torch
and starts its runtime) plus the Ascend device nodes ``/dev/davinci<N>``. The platform's methods import
torch_npu on first use, in the worker.
"""

from __future__ import annotations

import glob
import importlib.util
from typing import Any, NamedTuple

from omni_core.platforms.interface import Platform

NAME = "npu"
#: one node per Ascend device (``/dev/davinci_manager`` and friends do not match)
DEVICE_GLOB = "/dev/davinci[0-9]*"


class NpuProbe(NamedTuple):
    """What detection looks at; ``probe()`` gathers it, tests substitute it."""

    torch_npu_installed: bool
    device_nodes: tuple[str, ...]


def probe() -> NpuProbe:
    """Gather the facts detection needs without importing torch or torch_npu."""
    try:
        installed = importlib.util.find_spec("torch_npu") is not None
    except (ImportError, ValueError):
        installed = False
    return NpuProbe(installed, tuple(sorted(glob.glob(DEVICE_GLOB))))


def detect() -> tuple[bool, str]:
    """``(detected, reason)`` for ``PlatformSpec.detect``: torch_npu installed and an Ascend device present."""
    p = probe()
    if not p.torch_npu_installed:
        return False, "torch_npu (Ascend's PyTorch adapter) is not installed"
    if not p.device_nodes:
        return False, f"torch_npu is installed but no Ascend device is present (nothing matches {DEVICE_GLOB})"
    return True, f"{len(p.device_nodes)} Ascend NPU(s) ({', '.join(p.device_nodes)})"


def _npu() -> Any:
    """``torch.npu``, which exists once torch_npu is imported."""
    import torch
    import torch_npu  # noqa: F401 - registers the npu device type and torch.npu

    return torch.npu


class NpuPlatform(Platform):
    name = NAME
    device_type = "npu"
    dist_backend = "hccl"
    default_dtype = "bfloat16"

    def is_available(self) -> tuple[bool, str]:
        return detect()

    def device_count(self) -> int:
        return _npu().device_count()

    def set_device(self, device: Any) -> None:
        _npu().set_device(device)

    def synchronize(self, device: Any = None) -> None:
        _npu().synchronize(device)

    def empty_cache(self) -> None:
        _npu().empty_cache()

    def memory_stats(self, device: Any = None) -> dict[str, int]:
        """Bytes ``allocated``/``reserved`` by torch_npu's allocator, plus the device's ``free`` and ``total``."""
        npu = _npu()
        free, total = npu.mem_get_info(device)
        return {"allocated": npu.memory_allocated(device), "reserved": npu.memory_reserved(device),
                "total": total, "free": free}

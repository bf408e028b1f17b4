"""The ``rocm`` platform: AMD GPUs through torch's ROCm (HIP) build, which answers to ``torch.cuda``.

Detection creates no device context: it reads ``torch.version.hip`` and counts devices with
``torch.cuda.device_count()``, which asks amdsmi first on ROCm builds and leaves
``torch.cuda.is_initialized()`` False (``torch.cuda.is_available()`` is avoided). The device methods and the
default-kernel choice come from the core's :class:`~omni_core.platforms.cuda_like.CudaLikePlatform` (HIP
devices are torch ``"cuda"`` devices, RCCL runs under torch's ``nccl`` name). torch is imported only inside
functions.
"""

from __future__ import annotations

from typing import NamedTuple

from omni_core.platforms.cuda_like import CudaLikePlatform

NAME = "rocm"


class RocmProbe(NamedTuple):
    """What detection looks at; ``probe()`` gathers it, tests substitute it."""

    torch_version: str | None  # None: torch is not importable
    hip: str | None  # torch.version.hip
    device_count: int


def probe() -> RocmProbe:
    """Gather the facts detection needs, without creating a device context."""
    try:
        import torch
    except ImportError:
        return RocmProbe(None, None, 0)
    hip = getattr(torch.version, "hip", None)
    return RocmProbe(torch.__version__, hip, torch.cuda.device_count() if hip else 0)


def detect() -> tuple[bool, str]:
    """``(detected, reason)`` for ``PlatformSpec.detect``: a ROCm build of torch that sees a GPU."""
    p = probe()
    if p.torch_version is None:
        return False, "torch is not installed"
    if not p.hip:
        return False, f"torch {p.torch_version} is not a ROCm build"
    if p.device_count <= 0:
        return False, (f"torch {p.torch_version} (HIP {p.hip}) sees no AMD GPU (no amdgpu driver, or "
                       f"HIP_VISIBLE_DEVICES/ROCR_VISIBLE_DEVICES hide them)")
    return True, f"{p.device_count} AMD GPU(s), torch {p.torch_version} (HIP {p.hip})"


class RocmPlatform(CudaLikePlatform):
    """A fast attention kernel by default on any GPU where one is installed and takes the head size and dtype
    (FLASH_ATTN: flash-attn for ROCm or aiter), else the portable one; the kernels' records decide."""

    name = NAME

    def is_available(self) -> tuple[bool, str]:
        return detect()

    def device_count(self) -> int:
        return probe().device_count

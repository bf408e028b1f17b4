"""The ``cuda`` platform: NVIDIA GPUs through torch's CUDA build.

Detection creates no CUDA context and does not poison ``fork``: it reads ``torch.version.cuda`` and counts
devices with ``torch.cuda.device_count()``, which asks NVML (documented: "will NOT poison fork if NVML
discovery succeeds") and leaves ``torch.cuda.is_initialized()`` False. ``torch.cuda.is_available()`` is
avoided because it calls ``cudaGetDeviceCount`` unless ``PYTORCH_NVML_BASED_CUDA_CHECK=1``. The device methods
and the default-kernel choice come from the core's :class:`~omni_core.platforms.cuda_like.CudaLikePlatform`.
This module imports torch only inside functions.
"""

from __future__ import annotations

from typing import NamedTuple

from omni_core.platforms.cuda_like import CudaLikePlatform

NAME = "cuda"
#: compute capabilities on which a fast attention kernel (FLASH_ATTN, where installed) may be the default:
#: Ampere .. Hopper, the range validated; elsewhere the portable kernel is
FAST_ATTENTION_CAPABILITIES = ((8, 0), (9, 0))


class CudaProbe(NamedTuple):
    """What detection looks at; ``probe()`` gathers it, tests substitute it."""

    torch_version: str | None  # None: torch is not importable
    cuda: str | None  # torch.version.cuda
    hip: str | None  # torch.version.hip
    device_count: int


def probe() -> CudaProbe:
    """Gather the facts detection needs, without creating a CUDA context."""
    try:
        import torch
    except ImportError:
        return CudaProbe(None, None, None, 0)
    cuda, hip = torch.version.cuda, getattr(torch.version, "hip", None)
    count = torch.cuda.device_count() if cuda else 0
    return CudaProbe(torch.__version__, cuda, hip, count)


def detect() -> tuple[bool, str]:
    """``(detected, reason)`` for ``PlatformSpec.detect``: a CUDA build of torch that sees a device."""
    p = probe()
    if p.torch_version is None:
        return False, "torch is not installed"
    if p.hip:
        return False, f"torch {p.torch_version} is a ROCm build (HIP {p.hip}); the rocm platform covers it"
    if not p.cuda:
        return False, f"torch {p.torch_version} is built without CUDA"
    if p.device_count <= 0:
        return False, (f"torch {p.torch_version} (CUDA {p.cuda}) sees no CUDA device (no driver or GPU, or "
                       f"CUDA_VISIBLE_DEVICES hides them)")
    return True, f"{p.device_count} CUDA device(s), torch {p.torch_version} (CUDA {p.cuda})"


class CudaPlatform(CudaLikePlatform):
    """A fast attention kernel by default on sm80..sm90 where an installed one is built for the GPU (FLASH_ATTN:
    current FA3 and flash-attn 2 both run on sm80+; FA3 is preferred on sm90), else the portable one."""

    name = NAME
    fast_attention_capabilities = FAST_ATTENTION_CAPABILITIES

    def is_available(self) -> tuple[bool, str]:
        return detect()

    def device_count(self) -> int:
        return probe().device_count

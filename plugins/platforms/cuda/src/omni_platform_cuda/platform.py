"""The ``cuda`` platform: NVIDIA GPUs through torch's CUDA build.

Detection creates no CUDA context and does not poison ``fork``: it reads ``torch.version.cuda`` and counts
devices with ``torch.cuda.device_count()``, which asks NVML (documented: "will NOT poison fork if NVML
discovery succeeds") and leaves ``torch.cuda.is_initialized()`` False. ``torch.cuda.is_available()`` is
avoided because it calls ``cudaGetDeviceCount`` unless ``PYTORCH_NVML_BASED_CUDA_CHECK=1``. This module
imports torch only inside functions.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from omni_core.platforms.interface import Platform

NAME = "cuda"
#: compute capabilities on which FLASH_ATTN is the default (Ampere .. Hopper)
FLASH_DEFAULT_CAPABILITIES = ((8, 0), (9, 0))


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


def capability(device: Any = None) -> tuple[int, int]:
    """Compute capability of ``device`` (default: the current one). Initialises CUDA, so runs in workers."""
    import torch

    return tuple(torch.cuda.get_device_capability(device))


def flash_attention_usable(head_size: int, dtype: Any, capability: tuple[int, int] | None = None
                           ) -> tuple[bool, str]:
    """Whether the FLASH_ATTN plugin is installed, its library imports, it takes this head size and dtype, and
    (given the GPU's ``capability``) an installed kernel is built for that architecture (FA3 alone on an
    Ampere GPU is not). Asks the registered backend itself, so the rules live in one place (the flash plugin).
    """
    from omni_core.plugins.manager import get_plugin_manager

    pm = get_plugin_manager()
    if "FLASH_ATTN" not in pm.components("attention"):
        return False, "the FLASH_ATTN plugin (omni-attention-flash) is not installed"
    backend = pm.load_component("attention", "FLASH_ATTN")
    ok, why = backend.is_available()
    if not ok:
        return False, why
    why = backend.check_head_size(head_size) or backend.check_call(dtype, "cuda", False, False)
    if not why and capability is not None:
        why = backend.check_capability(capability)
    return (False, why) if why else (True, "")


class CudaPlatform(Platform):
    name = NAME
    device_type = "cuda"
    dist_backend = "nccl"
    default_dtype = "bfloat16"

    def is_available(self) -> tuple[bool, str]:
        return detect()

    def device_count(self) -> int:
        return probe().device_count

    def set_device(self, device: Any) -> None:
        import torch

        torch.cuda.set_device(device)

    def synchronize(self, device: Any = None) -> None:
        import torch

        torch.cuda.synchronize(device)

    def empty_cache(self) -> None:
        import torch

        torch.cuda.empty_cache()

    def memory_stats(self, device: Any = None) -> dict[str, int]:
        """Bytes ``allocated``/``reserved`` by torch's allocator, plus the device's ``free`` and ``total``."""
        import torch

        free, total = torch.cuda.mem_get_info(device)
        return {"allocated": torch.cuda.memory_allocated(device), "reserved": torch.cuda.memory_reserved(device),
                "total": total, "free": free}

    def default_attention_backend(self, head_size: int, dtype: Any) -> str:
        """FLASH_ATTN on sm80..sm90 when it is installed, takes ``head_size``/``dtype`` and has a kernel built for
        this GPU (FA3 runs on sm90 only, flash-attn 2 on sm80+), else TORCH_SDPA."""
        low, high = FLASH_DEFAULT_CAPABILITIES
        cap = capability()
        if low <= cap <= high:
            ok, _ = flash_attention_usable(head_size, dtype if dtype is not None else self.default_dtype, cap)
            if ok:
                return "FLASH_ATTN"
        return "TORCH_SDPA"

"""The ``rocm`` platform: AMD GPUs through torch's ROCm (HIP) build, which answers to ``torch.cuda``.

Detection creates no device context: it reads ``torch.version.hip`` and counts devices with
``torch.cuda.device_count()``, which asks amdsmi first on ROCm builds and leaves
``torch.cuda.is_initialized()`` False (``torch.cuda.is_available()`` is avoided). torch is imported only
inside functions.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from omni_core.platforms.interface import Platform

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


def flash_attention_usable(head_size: int, dtype: Any) -> tuple[bool, str]:
    """Whether the FLASH_ATTN plugin is installed, has a kernel library (flash-attn for ROCm or aiter) that
    imports, and takes this head size and dtype. Asks the registered backend, so its rules live in one place.
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
    return (False, why) if why else (True, "")


class RocmPlatform(Platform):
    name = NAME
    device_type = "cuda"  # HIP devices are torch "cuda" devices
    dist_backend = "nccl"  # RCCL, under torch's nccl name
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
        """FLASH_ATTN when it is installed (flash-attn ROCm or aiter) and takes ``head_size``/``dtype``."""
        ok, _ = flash_attention_usable(head_size, dtype if dtype is not None else self.default_dtype)
        return "FLASH_ATTN" if ok else "TORCH_SDPA"

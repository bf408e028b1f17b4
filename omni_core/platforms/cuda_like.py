"""The base of platforms that run through torch's ``torch.cuda`` API (NVIDIA CUDA, AMD ROCm/HIP).

Both answer to ``torch.cuda`` with torch device type ``"cuda"`` and torch's ``nccl`` backend (RCCL on ROCm), so
the device methods and the choice of the default attention kernel live here once; a plugin declares only what
differs (its name, its detection, the compute capabilities on which FLASH_ATTN is the default). torch is
imported inside methods only, so importing a platform plugin stays cheap and creates no device context.
"""

from __future__ import annotations

from typing import Any

from omni_core.platforms.interface import Platform

FLASH_ATTN = "FLASH_ATTN"
FALLBACK_ATTENTION = "TORCH_SDPA"


def flash_attention_usable(head_size: int, dtype: Any, capability: tuple[int, int] | None = None, *,
                           device_type: str = "cuda", pm: Any = None) -> tuple[bool, str]:
    """Whether the FLASH_ATTN plugin is installed and, by its own rules (the availability walk), runs here for
    this head size and dtype and (given the GPU's ``capability``) has a kernel built for that architecture."""
    from omni_core.plugins.availability import Context, check_record

    if pm is None:
        from omni_core.plugins.manager import get_plugin_manager

        pm = get_plugin_manager()
    spec = pm.components("attention").get(FLASH_ATTN)
    if spec is None:
        return False, "the FLASH_ATTN plugin (omni-attention-flash) is not installed"
    av = check_record(spec, Context(device_type=device_type, dtype=dtype, head_size=head_size, capability=capability))
    return av.ok, av.reason


class CudaLikePlatform(Platform):
    """A platform driven through ``torch.cuda``; subclasses set ``name`` and implement ``is_available`` and
    ``device_count`` (detection differs), and may bound where FLASH_ATTN is the default."""

    device_type = "cuda"
    dist_backend = "nccl"
    default_dtype = "bfloat16"
    #: inclusive range of compute capabilities on which FLASH_ATTN may be the default (None: no bound, and the
    #: capability is not asked)
    flash_capabilities: tuple[tuple[int, int], tuple[int, int]] | None = None

    def set_device(self, device: Any) -> None:
        import torch

        torch.cuda.set_device(device)

    def synchronize(self, device: Any = None) -> None:
        import torch

        torch.cuda.synchronize(device)

    def empty_cache(self) -> None:
        import torch

        torch.cuda.empty_cache()

    def peak_memory_bytes(self, device: Any = None) -> int:
        """Peak bytes held by torch's allocator on ``device`` (``torch.cuda.max_memory_allocated``)."""
        import torch

        return int(torch.cuda.max_memory_allocated(device))

    def reset_peak_memory(self, device: Any = None) -> None:
        """``torch.cuda.reset_peak_memory_stats``: the peak starts again at what is allocated now."""
        import torch

        torch.cuda.reset_peak_memory_stats(device)

    def memory_stats(self, device: Any = None) -> dict[str, int]:
        """Bytes ``allocated``/``reserved`` by torch's allocator, plus the device's ``free`` and ``total``."""
        import torch

        free, total = torch.cuda.mem_get_info(device)
        return {"allocated": torch.cuda.memory_allocated(device), "reserved": torch.cuda.memory_reserved(device),
                "total": total, "free": free}

    def capability(self, device: Any = None) -> tuple[int, int]:
        """Compute capability of ``device`` (default: the current one). Initialises the device runtime, so it is
        asked only where a model runs (workers)."""
        import torch

        return tuple(torch.cuda.get_device_capability(device))

    def flash_attention_usable(self, head_size: int, dtype: Any, capability: tuple[int, int] | None = None
                               ) -> tuple[bool, str]:
        """:func:`flash_attention_usable` on this platform's device type."""
        return flash_attention_usable(head_size, dtype, capability, device_type=self.device_type)

    def default_attention_backend(self, head_size: int, dtype: Any) -> str:
        """FLASH_ATTN where it is installed, takes ``head_size``/``dtype`` (None: the platform's default dtype) and,
        if ``flash_capabilities`` bounds it, this GPU is in range and has a kernel built for it; else TORCH_SDPA."""
        cap = None
        if self.flash_capabilities is not None:
            low, high = self.flash_capabilities
            cap = self.capability()
            if not low <= cap <= high:
                return FALLBACK_ATTENTION
        ok, _ = self.flash_attention_usable(head_size, dtype if dtype is not None else self.default_dtype, cap)
        return FLASH_ATTN if ok else FALLBACK_ATTENTION

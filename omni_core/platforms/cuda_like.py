"""The base of platforms that run through torch's ``torch.cuda`` API (NVIDIA CUDA, AMD ROCm/HIP).

Both answer to ``torch.cuda`` with torch device type ``"cuda"`` and torch's ``nccl`` backend (RCCL on ROCm), so
the device methods and the rule for the default attention kernel live here once; a plugin declares only what
differs (its name, its detection, the compute capabilities on which a fast kernel may be the default; which
kernel that is, the installed backends' records say). torch is imported inside methods only, so importing a
platform plugin stays cheap and creates no device context.
"""

from __future__ import annotations

from typing import Any

from omni_core.platforms.interface import Platform


class CudaLikePlatform(Platform):
    """A platform driven through ``torch.cuda``; subclasses set ``name`` and implement ``is_available`` and
    ``device_count`` (detection differs), and may bound where a fast attention kernel is the default."""

    device_type = "cuda"
    dist_backend = "nccl"
    default_dtype = "bfloat16"
    #: inclusive range of compute capabilities on which a fast (non-portable) attention kernel may be the default
    #: (None: no bound, and the capability is not asked); outside it the portable one is
    fast_attention_capabilities: tuple[tuple[int, int], tuple[int, int]] | None = None

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

    def fast_attention_allowed(self) -> tuple[bool, tuple[int, int] | None]:
        """A fast kernel only on a GPU inside ``fast_attention_capabilities`` (asked only when it bounds), and
        that kernel must have been built for this GPU's capability (its record's walk checks it)."""
        if self.fast_attention_capabilities is None:
            return True, None
        low, high = self.fast_attention_capabilities
        cap = self.capability()
        return low <= cap <= high, cap

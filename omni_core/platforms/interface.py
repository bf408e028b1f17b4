"""The platform interface: what the runtime needs to know about a kind of device.

Platform classes are instantiated cheaply (no device context); methods that need torch import it lazily.
"""

from __future__ import annotations

from typing import Any


class Platform:
    """Base class of every platform (``cpu`` in the core; ``cuda``, ``rocm``, ``npu`` as plugins)."""

    #: component name (``OMNI_PLATFORM`` value)
    name: str = ""
    #: torch device type (``"cpu"``, ``"cuda"``, ``"npu"``)
    device_type: str = ""
    #: torch.distributed backend for collectives between workers
    dist_backend: str = "gloo"
    #: dtype used when the config says ``"auto"``
    default_dtype: str = "float32"

    def is_available(self) -> tuple[bool, str]:
        """Whether this platform can run here, and why not."""
        return True, ""

    def device_count(self) -> int:
        return 1

    def max_world_size(self) -> tuple[int, str]:
        """How many worker processes this machine can place (one per device), and what they are, for errors."""
        n = self.device_count()
        return n, f"{n} {self.name} device(s)"

    def get_torch_device(self, rank: int = 0) -> Any:
        """The torch device a worker of local ``rank`` uses."""
        import torch

        return torch.device(self.device_type, rank % max(self.device_count(), 1))

    def set_device(self, device: Any) -> None:
        """Make ``device`` current for this process (no-op where devices have no notion of current)."""

    def synchronize(self, device: Any = None) -> None:
        """Wait for queued work on ``device`` (used before timing)."""

    def empty_cache(self) -> None:
        """Return cached allocator memory to the device."""

    def memory_stats(self, device: Any = None) -> dict[str, int]:
        """Bytes ``allocated``, ``reserved``, ``total`` on ``device`` (0 where unknown)."""
        return {"allocated": 0, "reserved": 0, "total": 0}

    def peak_memory_bytes(self, device: Any = None) -> int:
        """The most memory this process has held on ``device`` since the last :meth:`reset_peak_memory` (0 where
        unknown). The runner resets it at the start of every wave, so each finished request's
        ``metrics["peak_memory_mb"]`` (the server's ``usage.peak_memory_mb``) is the peak of the waves it ran in,
        not of the process's life."""
        return 0

    def reset_peak_memory(self, device: Any = None) -> None:
        """Start a new peak for :meth:`peak_memory_bytes` at what ``device`` holds now (no-op where unknown)."""

    def default_attention_backend(self, head_size: int, dtype: Any) -> str:
        """The attention backend this platform prefers for a head size and dtype."""
        return "TORCH_SDPA"

    def describe(self) -> dict[str, Any]:
        ok, reason = self.is_available()
        return {"name": self.name, "device_type": self.device_type, "dist_backend": self.dist_backend,
                "available": ok, "reason": reason}

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"

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

    def fast_attention_allowed(self) -> tuple[bool, tuple[int, int] | None]:
        """Whether a fast (non-portable) attention kernel may be the default here, and the compute capability it
        must serve (None: not asked). The platform states this preference; the kernels' records decide the rest."""
        return True, None

    def default_attention_backend(self, head_size: int, dtype: Any) -> str:
        """The attention backend to use here for a head size and dtype (None: the platform's default dtype) when
        nothing names one: the installed backends' records decide
        (:func:`~omni_core.plugins.attention_default.default_backend`), within :meth:`fast_attention_allowed`."""
        from omni_core.plugins.attention_default import default_backend

        fast, capability = self.fast_attention_allowed()
        return default_backend(device_type=self.device_type, dtype=dtype if dtype is not None else self.default_dtype,
                               head_size=head_size, capability=capability, portable_only=not fast)

    def describe(self) -> dict[str, Any]:
        ok, reason = self.is_available()
        return {"name": self.name, "device_type": self.device_type, "dist_backend": self.dist_backend,
                "available": ok, "reason": reason}

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"

"""The CPU platform: always available, the fallback when no accelerator platform is detected."""

from __future__ import annotations

import os
from typing import Any

from omni_core.platforms.interface import Platform


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    default_dtype = "float32"

    def device_count(self) -> int:
        return 1

    def max_world_size(self) -> tuple[int, str]:
        """One worker per usable CPU core: more processes only time-slice the same cores (each rank's step
        waits for the slowest), so they cost start-up time and memory without adding throughput."""
        from omni_core.platforms.threads import usable_cpu_cores

        n = usable_cpu_cores()
        return n, f"{n} usable CPU core(s)"

    def get_torch_device(self, rank: int = 0) -> Any:
        import torch

        return torch.device("cpu")

    def peak_memory_bytes(self, device: Any = None) -> int:
        """The process's peak resident set (``ru_maxrss``, KiB on Linux): CPU tensors live in it."""
        try:
            import resource

            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        except (ImportError, OSError):
            return 0

    def memory_stats(self, device: Any = None) -> dict[str, int]:
        total = 0
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            pass
        rss = 0
        try:
            with open("/proc/self/statm") as f:
                rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            pass
        return {"allocated": rss, "reserved": rss, "total": total}

"""The CPU thread policy: how many torch threads each model process runs with. One knob, ``cpu_threads``.

Every model process (the engine's own with the ``uni`` executor, each worker with ``mp``) sets
``torch.set_num_threads`` once when it starts, to ``cpu_threads`` if given, else to the usable CPU cores
of this machine divided by the model processes that share them (at least one). Nothing changes the count
per call: switching it around every op costs more than it saves, and a batch of requests needs every core
(on the 2-core CI machine, ``shapes`` at batch 8 runs 1.25x faster with both cores than with one, while a
lone request takes the same time with one or two; ``bench/hot_path.py``). On a GPU the same count covers
the host-side ops (prompt encoding, schedulers, image conversion).

Only the model's thread should run torch ops with more than one thread: GNU OpenMP keeps a team per calling thread,
and once a process holds more OpenMP threads than cores it stops letting idle ones spin, so every op of the model
starts by waking its team (a lone ``shapes`` step 21% slower on 2 cores with one extra team). The engine's other
threads run on one torch thread (:func:`one_thread_here`) or in numpy (``omni_core.images``); docs/runtime.md.
"""

from __future__ import annotations

import os
import sys
from typing import Any


def usable_cpu_cores() -> int:
    """CPU cores this process may run on (its affinity mask, e.g. a container's cpuset), else all."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def threads_per_process(config: Any, processes: int = 1) -> int:
    """The thread count of one model process: ``config.cpu_threads``, or usable cores // processes."""
    configured = getattr(config, "cpu_threads", None)
    if configured:
        return configured
    return max(1, usable_cpu_cores() // max(1, processes))


def apply_thread_policy(config: Any, processes: int = 1) -> int:
    """Set torch's intra-op thread count for this process (once, at start); returns it."""
    import torch

    n = threads_per_process(config, processes)
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n


def one_thread_here() -> None:
    """Run this thread's torch ops on one thread, if torch is loaded (else nothing to do).

    For the engine's helper threads (output delivery), whose ops are small (an image to PIL). With more,
    each op wakes an OpenMP team whose threads then spin-wait for the next parallel region, on the cores the
    model runs on: measured on 2 cores with ``mp`` (``shapes``, step mode), the delivery thread's team burned
    1.5-1.8 ms of CPU per 45 ms step, and the engine's process 3.2 ms in all; with one thread, 1.0 ms."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() != 1:
        # per thread under OpenMP: threads that already ran torch ops keep their count; new ones start from
        # this one, so the runner sets its own count per wave (``worker/lanes.py``)
        torch.set_num_threads(1)


def thread_policy(config: Any = None, processes: int = 1) -> str:
    """A one-line description for benchmark headers and ``omni env``."""
    n = threads_per_process(config, processes)
    how = "cpu_threads" if getattr(config, "cpu_threads", None) else f"{usable_cpu_cores()} usable cores / {processes}"
    return f"torch threads per model process: {n} ({how})"

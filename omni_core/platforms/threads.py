"""The CPU thread policy: how many torch threads each model process runs with. One knob, ``cpu_threads``.

Every model process (the engine's own with the ``uni`` executor, each worker with ``mp``) sets
``torch.set_num_threads`` once when it starts, to ``cpu_threads`` if given, else to ``OMP_NUM_THREADS`` if set,
else to the usable CPU cores of this machine divided by the model processes that share them (at least one). Nothing changes the count
per call: switching it around every op costs more than it saves, and a batch of requests needs every core
(on the 2-core CI machine, ``shapes`` at batch 8 runs 1.25x faster with both cores than with one, while a
lone request takes the same time with one or two; ``bench/hot_path.py``). On a GPU the same count covers
the host-side ops (prompt encoding, schedulers, image conversion).

Only the model's thread should run torch ops with more than one thread: GNU OpenMP keeps a team per calling thread,
and once a process holds more OpenMP threads than cores it stops letting idle ones spin, so every op of the model
starts by waking its team (a lone ``shapes`` step 21% slower on 2 cores with one extra team). The engine's other
threads run no torch op, and what the engine does in a caller's thread runs on one torch thread
(:func:`one_torch_thread`) or in numpy (``omni_core.images``); docs/runtime.md.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Iterator


#: where the cgroup file systems are mounted; ``OMNI_CGROUP_ROOT`` points elsewhere (tests use a fake tree)
CGROUP_ROOT = "/sys/fs/cgroup"


def usable_cpu_cores(cgroup_root: str | None = None, proc_cgroup: str = "/proc/self/cgroup") -> int:
    """CPU cores this process may run on: its affinity mask (a container's cpuset), capped by its cgroup's CPU
    quota (``cpu.max``, or v1's ``cpu.cfs_quota_us``), rounded down and at least one. A quota of 1.5 cores gives
    one thread: a second would run only while quota is left, and every op would wait at OpenMP's barrier for it."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        cores = os.cpu_count() or 1
    quota = cgroup_cpu_quota(cgroup_root or os.environ.get("OMNI_CGROUP_ROOT") or CGROUP_ROOT, proc_cgroup)
    if quota is not None:
        cores = min(cores, max(1, int(quota)))
    return cores


def cgroup_cpu_quota(root: str, proc_cgroup: str = "/proc/self/cgroup") -> float | None:
    """This process's CPU quota in cores (quota / period), the smallest along its cgroup and the cgroups above
    it, or None when unlimited or unreadable. cgroup v2: ``<root>/<path>/cpu.max`` ("max 100000" or
    "150000 100000"); v1: ``<root>/cpu[,cpuacct]/<path>/cpu.cfs_quota_us`` and ``cpu.cfs_period_us``."""
    try:
        with open(proc_cgroup) as f:
            lines = [line.strip().split(":", 2) for line in f if line.count(":") >= 2]
    except OSError:
        lines = []
    dirs: list[str] = []
    for _, controllers, path in lines or [("0", "", "/")]:
        if controllers == "":  # v2's unified hierarchy
            dirs.append(os.path.join(root, path.lstrip("/")))
        elif "cpu" in controllers.split(","):
            for mount in (controllers, "cpu", "cpu,cpuacct"):
                dirs.append(os.path.join(root, mount, path.lstrip("/")))
    limits = []
    for start in dirs:
        d = os.path.normpath(start)
        while True:
            limit = _quota_in(d)
            if limit is not None:
                limits.append(limit)
            if os.path.normpath(d) == os.path.normpath(root) or len(d) <= len(root):
                break
            d = os.path.dirname(d)
    return min(limits) if limits else None


def _quota_in(folder: str) -> float | None:
    def read(name: str) -> str | None:
        try:
            with open(os.path.join(folder, name)) as f:
                return f.read().strip()
        except OSError:
            return None

    v2 = read("cpu.max")
    if v2:
        quota, _, period = v2.partition(" ")
        if quota != "max" and quota.isdigit() and period.isdigit() and int(period) > 0:
            return int(quota) / int(period)
        return None
    quota, period = read("cpu.cfs_quota_us"), read("cpu.cfs_period_us")
    if quota and period and quota.lstrip("-").isdigit() and period.isdigit() and int(quota) > 0 and int(period) > 0:
        return int(quota) / int(period)
    return None


class ContentionGauge:
    """Whether other work is queueing for this machine's cores, from the kernel's CPU pressure (PSI's
    ``/proc/pressure/cpu``, "some" total: microseconds in which a runnable task waited for a core).

    Why the engine watches it: an op split over N OpenMP threads ends when its slowest thread does, and on a
    shared CPU a thread is often descheduled, so every op waits a scheduler time slice at the barrier (measured
    on 2 cores with two busy processes, ``bench/contention.py``: the default ran 2-10x slower than one thread,
    spinning or passive). While the cores are contended the model process runs one thread; when the pressure
    is gone it goes back to its budget. Going up is retried with a back-off that doubles while it keeps failing
    (one busy process on 2 cores: our second thread is itself what makes the pressure), up to ``max_backoff_s``.
    """

    def __init__(self, path: str = "/proc/pressure/cpu", interval_s: float = 0.25, high: float = 0.10,
                 low: float = 0.02, max_backoff_s: float = 30.0, clock=None) -> None:
        import time

        self.path, self.interval_s, self.high, self.low, self.max_backoff_s = path, interval_s, high, low, max_backoff_s
        self._clock = clock or time.monotonic
        self.contended = False
        self._backoff_s = 1.0
        self._since = float("-inf")  # when the current state began (the first one counts as long ago)
        self._last = self._sample()
        #: whether the kernel reports CPU pressure here (else the gauge never reports contention)
        self.available = self._last is not None

    def _sample(self) -> tuple[float, int] | None:
        try:
            with open(self.path) as f:
                some = f.readline().split()
            return self._clock(), int(next(x for x in some if x.startswith("total=")).split("=")[1])
        except (OSError, StopIteration, ValueError):
            return None

    def threads(self, budget: int) -> int:
        """The thread count to run the next wave with: ``budget``, or 1 while the cores are contended."""
        if budget <= 1 or not self.available:
            return budget
        now = self._clock()
        if now - self._last[0] >= self.interval_s:
            sample = self._sample()
            if sample is not None:
                stall = (sample[1] - self._last[1]) / 1e6 / max(1e-9, sample[0] - self._last[0])
                self._last = sample
                if not self.contended and stall > self.high:
                    # down at once; the next try up waits longer if the last one came straight back down
                    self._backoff_s = (min(self.max_backoff_s, self._backoff_s * 2)
                                       if now - self._since < 2 * self._backoff_s else 1.0)
                    self.contended, self._since = True, now
                elif self.contended and stall < self.low and now - self._since >= self._backoff_s:
                    self.contended, self._since = False, now
        return 1 if self.contended else budget


def threads_per_process(config: Any, processes: int = 1) -> int:
    """The thread budget of one model process: ``config.cpu_threads``; else an explicit ``OMP_NUM_THREADS`` (what
    torch itself honours, and what a job sharing the machine sets: a test run, a batch scheduler's slot); else usable
    cores // processes. Without ``cpu_threads`` the runner lowers it to one while the CPU is contended
    (:class:`ContentionGauge`)."""
    configured = getattr(config, "cpu_threads", None)
    if configured:
        return configured
    omp = omp_num_threads()
    if omp is not None:
        return omp
    return max(1, usable_cpu_cores() // max(1, processes))


def omp_num_threads() -> int | None:
    """``OMP_NUM_THREADS`` when set to a positive count (a list such as "4,2" gives its first level), else None."""
    first = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    return int(first) if first.isdigit() and int(first) > 0 else None


def apply_thread_policy(config: Any, processes: int = 1) -> int:
    """Set torch's intra-op thread count for this process (once, at start); returns it."""
    import torch

    n = threads_per_process(config, processes)
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """Run the block's torch ops on one thread, if torch is loaded, and give the thread its count back after.

    For work the engine does in a caller's thread (post-processing a finished image where the caller reads it),
    whose ops are small. With more threads each op wakes an OpenMP team whose threads then spin-wait for the next
    parallel region, on the cores the model runs on: measured on 2 cores with ``mp`` (``shapes``, step mode), such
    a team burned 1.5-1.8 ms of CPU per 45 ms step, and the engine's process 3.2 ms in all; with one thread,
    1.0 ms. The caller's own count comes back (per thread under OpenMP), so its own torch work is unchanged."""
    torch = sys.modules.get("torch")
    before = torch.get_num_threads() if torch is not None else 1
    if before != 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if before != 1:
            torch.set_num_threads(before)


def thread_policy(config: Any = None, processes: int = 1) -> str:
    """A one-line description for benchmark headers and ``omni env``."""
    n = threads_per_process(config, processes)
    how = ("cpu_threads" if getattr(config, "cpu_threads", None)
           else "OMP_NUM_THREADS" if omp_num_threads() is not None
           else f"{usable_cpu_cores()} usable cores / {processes}; 1 while the CPU is contended")
    return f"torch threads per model process: {n} ({how})"

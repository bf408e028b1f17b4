"""A worker process dies with the process that started it.

Without this, a SIGKILLed (or OOM-killed) engine process leaves its workers running forever under PID 1,
holding memory (device memory on a GPU). Two mechanisms, both armed by ``die_with_parent``:

* Linux: ``prctl(PR_SET_PDEATHSIG, SIGKILL)``; the kernel kills the worker when its parent goes. It fires
  when the parent *thread* that started the worker exits, so the ``mp`` executor starts its workers from a
  thread that lives until they have all exited.
* Everywhere: a daemon thread that exits the worker once the engine's process is gone. A ``multiprocessing`` child
  watches the sentinel its creator left it (a pipe that reaches end-of-file when the creating process dies, under
  spawn and the fork server alike: a fork-server child's parent PID is the server's, not the engine's); any other
  process polls its parent PID.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1


def set_death_signal() -> bool:
    """Ask the kernel to SIGKILL this process when its parent dies; False where unsupported (not Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _parent_gone(parent_pid: int) -> None:
    sys.stderr.write(f"omni worker {os.getpid()}: parent process {parent_pid} is gone; exiting\n")
    sys.stderr.flush()
    from omni_core.processes.segments import remove_segments_of

    remove_segments_of(os.getpid())  # a send cut short by this exit must not leave its segment behind
    os._exit(1)


def watch_parent(parent_pid: int, interval: float = 1.0) -> threading.Thread:
    """Start a daemon thread that exits this process once its parent is no longer ``parent_pid``."""

    def run() -> None:
        while True:
            if os.getppid() != parent_pid:  # orphans are re-parented (to PID 1 or a subreaper)
                _parent_gone(parent_pid)
            time.sleep(interval)

    thread = threading.Thread(target=run, name="omni-parent-watch", daemon=True)
    thread.start()
    return thread


def watch_creator(sentinel: int, parent_pid: int) -> threading.Thread:
    """Start a daemon thread that exits this process once ``sentinel`` (the creator's end of a pipe) is closed."""
    import multiprocessing.connection

    def run() -> None:
        multiprocessing.connection.wait([sentinel])
        _parent_gone(parent_pid)

    thread = threading.Thread(target=run, name="omni-parent-watch", daemon=True)
    thread.start()
    return thread


def die_with_parent(parent_pid: int, interval: float = 1.0) -> None:
    """Arm both mechanisms; exits at once if the parent already died before the death signal was set."""
    set_death_signal()
    import multiprocessing

    creator = multiprocessing.parent_process()
    if creator is not None and creator.pid == parent_pid and creator.sentinel is not None:
        if not creator.is_alive():
            _parent_gone(parent_pid)
        watch_creator(creator.sentinel, parent_pid)
        return
    if os.getppid() != parent_pid:
        _parent_gone(parent_pid)
    watch_parent(parent_pid, interval)

"""How Omni starts a process of its own (a model worker, a stage process, ``spawn_workers``): one start method,
one preload, and what every such child does first.

Why a fork server rather than plain spawn: a spawned child is a fresh interpreter that imports torch, diffusers and
transformers again before it can load a model, 3-5 s of CPU per process on 2 cores (and a world of 2 with both
stages apart starts four such processes at once). The fork server imports them once (:mod:`omni_core.processes.preload`),
then forks every child from that clean, single-threaded process: a child starts with the libraries loaded, and the
engine's own process, with its threads, is never forked. This is Python's ``forkserver`` start method with a preload
list; a second engine in the same process (a test suite, several models behind one server) pays nothing more.

What a fork-server child does not inherit from the engine's process, and how it gets it (:func:`child_setup`):

* the environment: the fork server keeps the one it started with, so the child is sent the caller's at start time;
* death with the parent: the child's parent is the fork server, so the death signal watches that one (which exits
  once the engine's process is gone), and a thread watches the engine's process itself through the sentinel
  ``multiprocessing`` gives every child (a pipe that reaches end-of-file when the creating process dies).

``OMNI_START_METHOD=spawn`` goes back to plain spawn (outside Linux it is the only choice Omni makes).
"""

from __future__ import annotations

import os
import sys
from typing import Any

#: the environment switch naming the start method (``forkserver`` or ``spawn``)
START_METHOD_ENV = "OMNI_START_METHOD"
#: what the fork server imports before it forks any child
PRELOAD_MODULE = "omni_core.processes.preload"


def start_method() -> str:
    """``forkserver`` on Linux unless ``OMNI_START_METHOD`` says ``spawn``; ``spawn`` elsewhere."""
    chosen = os.environ.get(START_METHOD_ENV, "").strip().lower()
    if chosen and chosen not in ("forkserver", "spawn"):
        from omni_core.errors import ConfigError

        raise ConfigError(f"{START_METHOD_ENV}={chosen!r} is not a start method Omni uses; allowed: forkserver, spawn",
                          field=START_METHOD_ENV)
    if chosen == "spawn" or not sys.platform.startswith("linux"):
        return "spawn"
    return "forkserver"


def process_context() -> Any:
    """The ``torch.multiprocessing`` context every Omni process is started from (its queues move tensors through
    shared memory); the fork server, when used, preloads :data:`PRELOAD_MODULE`."""
    import torch.multiprocessing as tmp  # registers the tensor reductions the queues use

    method = start_method()
    if method == "forkserver":
        _preload()
    return tmp.get_context(method)


def _preload() -> None:
    """Name what the fork server imports (read when it starts, once per engine process); the stdlib's server is
    the one torch's contexts use, so this needs no torch."""
    from multiprocessing import forkserver

    forkserver.set_forkserver_preload([PRELOAD_MODULE])


def start_server_soon() -> None:
    """Start the fork server now (if it is the start method and not running yet), so that its preload overlaps
    the caller's own work. Returns at once (a fork and exec: ~5 ms): the server imports its preload by itself, and
    the first process started waits for it then. The server is the process's, not an engine's: it stays, idle,
    for the next engine (a refused plan leaves only it)."""
    if start_method() != "forkserver":
        return
    from multiprocessing import forkserver

    _preload()  # before the server starts
    forkserver.ensure_running()


def child_environment() -> dict[str, str]:
    """The caller's environment, for :func:`child_setup` (a fork-server child would otherwise see the server's)."""
    return dict(os.environ)


def child_setup(parent_pid: int | None, environment: dict[str, str] | None, name: str | None = None) -> None:
    """What every Omni child process does first: die with ``parent_pid`` (the engine's process), take the caller's
    ``environment``, keep the optional libraries' import noise down, and carry ``name`` as its process name (what
    ``ps -o comm``, ``top`` and ``/proc/PID/comm`` show: ``omni-worker-0``, ``omni-encode``, ``omni-decode``;
    fork-server children would all show the server's command line otherwise)."""
    if name:
        set_process_name(name)
    if parent_pid is not None:
        from omni_core.processes.parent_watch import die_with_parent

        die_with_parent(parent_pid)
    if environment is not None and environment != os.environ:
        os.environ.clear()
        os.environ.update(environment)
        import importlib

        importlib.invalidate_caches()  # folders a test (or a user) added since the server started
    from omni_core.utils.quiet import quiet_optional_libraries

    quiet_optional_libraries()


def set_process_name(name: str) -> bool:
    """This process's name (Linux ``PR_SET_NAME``: 15 bytes at most); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(15, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0) == 0  # 15: PR_SET_NAME
    except (OSError, AttributeError):
        return False


__all__ = ["PRELOAD_MODULE", "START_METHOD_ENV", "child_environment", "child_setup", "process_context",
           "set_process_name", "start_method", "start_server_soon"]

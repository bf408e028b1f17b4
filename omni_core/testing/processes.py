"""The processes a test started, read from ``/proc`` (Linux): which are alive, and everything below a PID. A fault
test checks "no process left" with these: a killed engine's workers, its fork server, its resource tracker."""

from __future__ import annotations

import os
from pathlib import Path


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def children(pid: int) -> list[int]:
    """PIDs whose parent is ``pid``."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry.name))
    return out


def descendants(pid: int) -> list[int]:
    """Every live PID below ``pid`` (children, their children, ...)."""
    found, todo = [], [pid]
    while todo:
        for child in children(todo.pop()):
            if alive(child):
                found.append(child)
                todo.append(child)
    return found


def name(pid: int) -> str:
    """The process's name (``/proc/PID/comm``: Omni's processes carry theirs, ``omni-worker-0``, ``omni-encode``)."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def named(pid: int, prefix: str) -> list[int]:
    """The processes below ``pid`` whose name starts with ``prefix`` (``named(server, "omni-worker-")``)."""
    return [p for p in descendants(pid) if name(p).startswith(prefix)]


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


__all__ = ["alive", "children", "cmdline", "descendants", "name", "named"]


def echo_rank(rank: int, task_q, result_q, abort_q, parent_pid: int, fail: bool = False) -> None:
    """A process body for :class:`~omni_core.executor.process_group.ProcessGroup` tests (and examples): say ready
    (or fail to start when ``fail``), then answer each ``("echo", x)`` with ``("echoed", rank, x, aborts seen)``
    until ``("shutdown",)``. Its aborts are read from ``abort_q`` before each answer."""
    import queue

    from omni_core.processes import child_setup

    child_setup(parent_pid, None, f"omni-echo-{rank}")
    if fail:
        result_q.put(("fatal", rank, "echo_rank was asked to fail"))
        return
    result_q.put(("ready", rank, {"pid": os.getpid()}))
    aborts: list[str] = []
    while (msg := task_q.get())[0] != "shutdown":
        while True:
            try:
                aborts.extend(abort_q.get_nowait())
            except queue.Empty:
                break
        result_q.put(("echoed", rank, msg[1], list(aborts)))

"""Shared-memory segments a process left behind when it died.

``torch.multiprocessing`` moves a tensor between processes through a segment it names ``/dev/shm/torch_<pid>_...``
and unlinks as soon as the descriptor is open (the receiver gets the descriptor, never the name). A process killed
between the two (a SIGKILL under load lands there now and then) leaves the segment in ``/dev/shm`` for good: memory
nothing frees until reboot, and no one but the dead process's parent knows that PID is gone. So the parent sweeps
a child's segments when it reaps the child, and a worker whose parent died sweeps its own before it exits. Removing
a name never hurts a process that holds the segment open: its mapping lives until it closes it.
"""

from __future__ import annotations

import os

#: where POSIX shared memory lives on Linux (elsewhere there is nothing to sweep)
SHM_DIR = "/dev/shm"


def segments_of(pid: int) -> list[str]:
    """Names of the torch segments ``pid`` created and has not unlinked."""
    prefix = f"torch_{pid}_"
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))
    except OSError:
        return []


def remove_segments_of(pid: int) -> list[str]:
    """Unlink what :func:`segments_of` finds (only for a process that is dead or about to exit); the names removed."""
    removed = []
    for name in segments_of(pid):
        try:
            os.unlink(os.path.join(SHM_DIR, name))
            removed.append(name)
        except OSError:  # gone already, or another sweeper was first
            pass
    return removed


__all__ = ["SHM_DIR", "remove_segments_of", "segments_of"]

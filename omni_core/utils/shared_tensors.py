"""Tensors handed from one process to another through one shared-memory segment (``update_weights`` from a trainer
in another process, issue #52): the sender writes every tensor's bytes once into a segment and sends only a small
handle (names, dtypes, shapes, offsets); the receiver maps the segment by name and copies each tensor out, so the
weights never travel through a pipe or a pickle. The sender owns the segment and unlinks it when the update
returned (:meth:`SharedTensors.close`)."""

from __future__ import annotations

from typing import Any

import attrs


@attrs.frozen
class SharedTensors:
    """A handle to tensors in the shared-memory segment ``segment``: ``entries`` of ``(name, dtype, shape, offset,
    nbytes)``. Picklable and small: what crosses the process boundary."""

    segment: str
    entries: tuple

    def close(self) -> None:
        """Unlink the segment (the sender, once the receiver has copied)."""
        from multiprocessing import shared_memory

        try:
            shm = shared_memory.SharedMemory(name=self.segment)
        except FileNotFoundError:
            return
        shm.close()
        shm.unlink()


def share_tensors(tensors: dict[str, Any]) -> SharedTensors:
    """Write ``tensors`` into a new shared-memory segment; returns its handle (call ``close`` after use)."""
    from multiprocessing import shared_memory

    import torch

    flat = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    entries, offset = [], 0
    for name, t in flat.items():
        nbytes = t.numel() * t.element_size()
        entries.append((name, str(t.dtype).removeprefix("torch."), tuple(t.shape), offset, nbytes))
        offset += nbytes
    shm = shared_memory.SharedMemory(create=True, size=max(offset, 1))
    try:
        for (name, _, _, start, nbytes), t in zip(entries, flat.values()):
            if nbytes:
                shm.buf[start:start + nbytes] = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        return SharedTensors(segment=shm.name, entries=tuple(entries))
    finally:
        shm.close()  # the segment lives on until ``close`` unlinks it


def send_shared(tensors: dict[str, Any], channel: Any) -> SharedTensors:
    """Share ``tensors`` and put the handle on ``channel`` (a multiprocessing queue or pipe end): what a trainer
    process runs to hand an engine its new weights."""
    handle = share_tensors(tensors)
    (channel.put if hasattr(channel, "put") else channel.send)(handle)
    return handle


def open_tensors(handle: SharedTensors) -> dict[str, Any]:
    """Copies of the tensors ``handle`` names (the segment may be unlinked afterwards)."""
    from multiprocessing import shared_memory

    import torch

    shm = shared_memory.SharedMemory(name=handle.segment)
    _untrack(shm)
    try:
        out = {}
        for name, dtype, shape, start, nbytes in handle.entries:
            raw = torch.frombuffer(bytearray(shm.buf[start:start + nbytes]), dtype=torch.uint8) if nbytes else \
                torch.empty(0, dtype=torch.uint8)
            out[name] = raw.view(getattr(torch, dtype)).reshape(shape)
        return out
    finally:
        shm.close()


def _untrack(shm: Any) -> None:
    """A receiver only reads the segment: Python's resource tracker would unlink it when this process ends (the
    sender owns it)."""
    from multiprocessing import resource_tracker

    try:
        resource_tracker.unregister(getattr(shm, "_name", "/" + shm.name), "shared_memory")
    except Exception:  # noqa: BLE001 - a platform without the tracker
        pass


__all__ = ["SharedTensors", "open_tensors", "send_shared", "share_tensors"]

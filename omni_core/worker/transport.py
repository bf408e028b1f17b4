"""How tensors cross between Omni's processes: a wave's outputs from a worker to the engine (small ones by value,
large ones in shared memory), and what one child makes for another (:class:`Sealed`).

``torch.multiprocessing`` moves every tensor through shared memory, which pays a segment and a descriptor
hand-over per tensor: four 3x32x32 images took 3.6 ms per round trip on the 2-core CI machine, against
0.36 ms as bytes in the message. Up to ``BY_VALUE_MAX_BYTES`` a tensor travels as bytes; above it, shared
memory saves the copy and wins.
"""

from __future__ import annotations

from typing import Any

import attrs

#: tensors up to this size travel inside the message (a 256x256 RGB float image is 768 KiB; a 512x512 one,
#: 3 MiB, goes through shared memory): small enough that a result message stays a few MiB at most
BY_VALUE_MAX_BYTES = 1024 * 1024
_FIELDS = ("tensor", "preview")


@attrs.frozen
class TensorBytes:
    """A CPU tensor as bytes: ``torch.frombuffer`` rebuilds it on the other side."""

    data: bytes
    dtype: str
    shape: tuple[int, ...]

    @classmethod
    def of(cls, t: Any) -> TensorBytes:
        t = t.detach().contiguous()
        return cls(t.view(-1).view(__import__("torch").uint8).numpy().tobytes(), str(t.dtype).split(".")[-1],
                   tuple(t.shape))

    def tensor(self) -> Any:
        import torch

        dtype = getattr(torch, self.dtype)
        if not self.data:
            return torch.empty(self.shape, dtype=dtype)
        return torch.frombuffer(bytearray(self.data), dtype=dtype).reshape(self.shape)


@attrs.frozen
class SealMode:
    """How a process seals what it makes for another (:class:`Sealed`): data the executor hands its processes,
    so the core names no transport's types.

    ``how``: ``"shm"`` shared-memory handles (one host, opened once), ``"value"`` the tensors' bytes (a consumer on
    another host, or several consumers), ``"ref"`` a handle in an object store named by ``store`` (``"module:attr"``
    of an object with ``put(value) -> ref`` and ``get(ref) -> value``; the Ray plugin's puts into Ray's object
    store, and the ref rides in the sealed value through the engine's Ray calls: the engine carries no bytes)."""

    how: str = "shm"
    store: str | None = None


#: the ``mp`` default: shared memory on this host
SHARED = SealMode()
#: the tensors' bytes in the sealed value
BY_VALUE = SealMode("value")
_stores: dict[str, Any] = {}


def _store(spec: str) -> Any:
    if spec not in _stores:
        import importlib

        module, _, attr = spec.partition(":")
        _stores[spec] = getattr(importlib.import_module(module), attr)
    return _stores[spec]


@attrs.frozen
class Sealed:
    """A value pickled where it was made and unpickled only where it is used, so a process that passes it on never
    rebuilds its tensors: the encode stage's text encodings on their way to the model process, a finished
    request's latents on their way to the decode stage (the engine's process holds only these bytes and ``meta``).

    ``seal(value)`` pickles with ``multiprocessing``'s pickler, which moves tensors to shared memory and sends a
    handle (a few hundred bytes, whatever the tensor's size); the handle is good once, on this host, while the
    sealing process lives: ``open()`` it exactly once. ``seal(value, mode=BY_VALUE)`` pickles the tensors'
    bytes instead (several consumers). ``mode=SealMode("ref", store)`` puts the value into an object store (Ray's)
    and carries only the store's ``ref`` (``data`` stays empty); ``open()`` gets it from the store, as often as
    needed. A sealed value that will never be used is ``discard()``-ed: a shared-memory one is opened and dropped,
    which frees its memory (an unopened handle holds it until its maker exits); a ref is freed by the store once
    the last holder drops it.
    """

    data: bytes
    meta: dict = attrs.field(factory=dict)
    how: str = "shm"
    #: ``how == "ref"``: the store's handle, and the store (``SealMode.store``)
    ref: Any = None
    store: str | None = None

    @property
    def by_value(self) -> bool:
        return self.how == "value"

    @classmethod
    def seal(cls, value: Any, *, by_value: bool = False, mode: SealMode | None = None, **meta: Any) -> Sealed:
        import io
        import pickle
        from multiprocessing.reduction import ForkingPickler

        mode = mode or (BY_VALUE if by_value else SHARED)
        if mode.how == "ref":
            return cls(b"", meta, "ref", _store(mode.store).put(value), mode.store)
        if mode.how == "value":
            return cls(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL), meta, "value")
        import torch.multiprocessing  # noqa: F401 - registers the shared-memory reductions of tensors

        buf = io.BytesIO()
        ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(value)
        return cls(buf.getvalue(), meta, "shm")

    def open(self) -> Any:
        if self.how == "ref":
            return _store(self.store).get(self.ref)
        import pickle

        import torch.multiprocessing  # noqa: F401 - the reductions that rebuild shared tensors

        return pickle.loads(self.data)

    def discard(self) -> None:
        """Let a value that will never be used go: a shared-memory one opened and dropped, which frees its memory;
        by value or a ref: nothing to do (the holder drops it); never raises (a maker that has exited took its
        memory with it)."""
        if self.how != "shm":
            return
        try:
            self.open()
        except Exception:  # noqa: BLE001 - the maker is gone, or the handle was used
            pass


def _small_cpu_tensor(t: Any) -> bool:
    import torch

    return isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.numel() * t.element_size() <= BY_VALUE_MAX_BYTES


def outputs_to_host(result: Any) -> Any:
    """Every output tensor of a ``RunnerOutput`` moved to the host (in place; returns it). Decoded images stay
    where the VAE ran (diffusers' ``postprocess(..., "pt")`` keeps the device), and a device tensor must not
    cross to the engine: ``mp`` would send a CUDA IPC handle (the engine's process then maps device memory and
    opens a context), Ray would pickle a CUDA storage (which a CPU-only driver cannot load). Called in the
    worker, once per wave, before the result is packed (and by the ``uni`` executor, for the same outputs)."""
    import torch

    for out in result.outputs.values():
        for name in _FIELDS:
            value = getattr(out, name)
            if isinstance(value, torch.Tensor) and value.device.type != "cpu":
                setattr(out, name, value.to("cpu"))
    return result


def pack_outputs(result: Any) -> Any:
    """Output tensors of a ``RunnerOutput`` moved to the host (:func:`outputs_to_host`), then the small ones ->
    ``TensorBytes`` (in place; returns it)."""
    outputs_to_host(result)
    for out in result.outputs.values():
        for name in _FIELDS:
            value = getattr(out, name)
            if value is not None and _small_cpu_tensor(value):
                setattr(out, name, TensorBytes.of(value))
    return result


def unpack_outputs(result: Any) -> Any:
    """The inverse of :func:`pack_outputs` (in place; returns it)."""
    for out in result.outputs.values():
        for name in _FIELDS:
            value = getattr(out, name)
            if isinstance(value, TensorBytes):
                setattr(out, name, value.tensor())
    return result

"""How a wave's output tensors cross from a worker to the engine: small ones by value, large ones in shared
memory.

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

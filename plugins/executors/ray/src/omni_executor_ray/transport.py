"""How a result's tensors travel from a rank's actor to the engine (as numpy arrays), and how what one actor makes
for another (encodings, latents) travels past it (as refs into Ray's object store: :class:`RayObjects`).

Ray serialises numpy arrays out of band (pickle 5 buffers, zero-copy into its object store) but pickles a
torch tensor's bytes in band. Measured with ``bench/executors.py`` (one wave's result, four float32 images,
median of 20 ``ray.get``, 2 cores at load average 4): 32x32 1.4 ms as numpy vs 2.1 ms with the engine's
``pack_outputs`` (bytes); 512x512 54 vs 95 ms; 1024x1024 318 vs 479 ms; 256x256 a tie (30 ms).
The engine copies each array once on arrival, so no returned tensor pins Ray's shared memory (and torch gets a
writable buffer). Device tensors are moved to the host first; tensors numpy cannot hold (bfloat16) are left to Ray's pickling.
"""

from __future__ import annotations

from typing import Any

_FIELDS = ("tensor", "preview")


def _numpy_ok(t: Any) -> bool:
    import torch

    return isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dtype not in (torch.bfloat16,) \
        and not t.requires_grad


def pack_for_ray(result: Any) -> Any:
    """Output tensors of a ``RunnerOutput`` moved to the host (a CUDA storage pickled by Ray would be rebuilt on
    the driver's GPU, or fail on a CPU-only driver), then -> numpy arrays where numpy can hold them (in place;
    returns it)."""
    from omni_core.worker.transport import outputs_to_host

    outputs_to_host(result)
    for out in result.outputs.values():
        for name in _FIELDS:
            value = getattr(out, name)
            if value is not None and _numpy_ok(value):
                setattr(out, name, value.detach().contiguous().numpy())
    return result


def unpack_from_ray(result: Any) -> Any:
    """The inverse of :func:`pack_for_ray` (in place; returns it), copying each array out of Ray's store."""
    import numpy as np
    import torch

    for out in result.outputs.values():
        for name in _FIELDS:
            value = getattr(out, name)
            if isinstance(value, np.ndarray):
                setattr(out, name, torch.from_numpy(np.array(value, copy=True)))
    return result


class RayObjects:
    """The object store of :data:`RAY_SEAL`: what a stage actor or a rank actor makes for another process is
    ``ray.put`` where it is made (owned by its maker) and ``ray.get`` where it is used. The ref rides inside a
    :class:`~omni_core.worker.transport.Sealed` through the engine's Ray calls (a nested ref in a call's arguments
    or return value, which Ray tracks: the object lives until the last holder drops it), so the engine's process
    carries a few dozen bytes per request, never an encoding's or a latent's."""

    @staticmethod
    def put(value: Any) -> Any:
        import ray

        return ray.put(value)

    @staticmethod
    def get(ref: Any) -> Any:
        import ray

        return ray.get(ref)


OBJECTS = RayObjects()


def ray_seal() -> Any:
    """The :class:`~omni_core.worker.transport.SealMode` the Ray executor hands its actors: refs into Ray's object
    store."""
    from omni_core.worker.transport import SealMode

    return SealMode("ref", store="omni_executor_ray.transport:OBJECTS")

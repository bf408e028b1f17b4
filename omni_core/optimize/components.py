"""The components of a loaded pipeline (its ``torch.nn.Module`` parts by name) and the bytes each holds.

Every optimisation (quantize, offload, VAE options) and ``stats()["model_bytes"]`` needs the same answer to
"which modules does this pipeline have": a diffusers-backed pipeline keeps them in ``pipeline.pipe.components``,
a hand-written one (``shapes``) as attributes. One function answers for both, so no option names a model.
"""

from __future__ import annotations

from typing import Any


def components_of(pipeline: Any) -> dict[str, Any]:
    """``{name: nn.Module}`` of the pipeline's model components (text encoders, denoisers, VAE), in the order
    they run (text encoders, denoisers, VAE: the chain model offload follows)."""
    import torch

    found: dict[str, Any] = {}
    inner = getattr(pipeline, "pipe", None)
    sources = [getattr(inner, "components", None) or {}] if inner is not None else []
    sources.append(vars(pipeline))
    for source in sources:
        for name, value in source.items():
            if isinstance(value, torch.nn.Module) and not name.startswith("_") and name not in found:
                found[name] = value

    def order(name: str) -> int:
        return 0 if name.startswith("text_encoder") else 2 if name.startswith("vae") else 1
    return dict(sorted(found.items(), key=lambda kv: order(kv[0])))


def tensor_bytes(t: Any) -> int:
    """Bytes a tensor really stores: a torchao quantized tensor (a wrapper subclass) counts its inner int8 data
    and scales, not the logical float size ``nbytes`` reports; a GGUF parameter its packed uint8 blocks."""
    flatten = getattr(t, "__tensor_flatten__", None)  # the tensor-subclass protocol torchao's tensors implement
    if flatten is not None:
        names, _ = flatten()
        return sum(tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def module_bytes(module: Any) -> int:
    """Bytes of a module's parameters and buffers (each tensor once, however often it is shared)."""
    seen: set[int] = set()
    total = 0
    for t in [*module.parameters(), *module.buffers()]:
        if id(t) in seen:
            continue
        seen.add(id(t))
        total += tensor_bytes(t)
    return total


def model_bytes(pipeline: Any) -> dict[str, int]:
    """``{component: bytes of its parameters and buffers}`` for one rank (``stats()["model_bytes"]``)."""
    return {name: module_bytes(m) for name, m in components_of(pipeline).items()}

"""Small helpers of the contract suites (:mod:`omni_core.testing.pipeline_contract`): kept apart so each suite
reads as its checks."""

from __future__ import annotations

from typing import Any


def final_output(handle: Any, timeout: float = 300) -> Any:
    """The last (finished) output of an engine request handle."""
    return handle.result(timeout)


def _two_values(field: Any) -> tuple[Any, Any]:
    """Two different valid values of a declared ``SamplingField`` (the default first where it has one)."""
    if field.type == "choice":
        return field.choices[0], field.choices[-1]
    if field.type == "bool":
        return False, True
    if field.type == "str":
        return "a", "b"
    lo = field.min if field.min is not None else 0
    hi = field.max if field.max is not None else lo + 2
    first = field.default if field.default is not None else lo + (hi - lo) / 4
    second = lo + (hi - lo) / 2 if first != lo + (hi - lo) / 2 else lo + (hi - lo) / 4
    return (int(first), int(second) if int(second) != int(first) else int(first) + 1) if field.type == "int" \
        else (float(first), float(second))


def omni_layers(pipeline: Any) -> list[Any]:
    """The ``OmniAttention`` layers inside the pipeline's declared denoisers, in module order."""
    from omni_core.attention import Attention
    from omni_core.pipelines.denoiser import denoisers_of

    seen: dict[int, Any] = {}
    for spec in denoisers_of(pipeline):
        seen.update((id(m), m) for m in spec.module.modules() if isinstance(m, Attention))
    return list(seen.values())


def torch_equal(a: Any, b: Any) -> bool:
    import torch

    return a.shape == b.shape and bool(torch.equal(a, b))


def load_model_cls(model: str) -> type:
    """The pipeline class behind ``model`` (resolved, not loaded)."""
    from omni_core.pipelines import resolve_model

    return resolve_model(model).pipeline_cls()


__all__ = ["final_output", "load_model_cls", "omni_layers", "torch_equal"]

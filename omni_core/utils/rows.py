"""Per-row helpers: pick, slice and join the rows of a batched denoiser call (every cache backend needs them,
through :mod:`omni_core.cache.rows`, and the forward context's row groups use them).

A batched call holds several requests (and CFG branches); a backend that decides per request runs only the
rows that must compute (TeaCache) or one call per request (cache-dit). These helpers do the row bookkeeping
once, for any model, from what a :class:`~omni_core.pipelines.denoiser.DenoiserSpec` declares as per-row.
"""

from __future__ import annotations

from typing import Any, Sequence


def span_index(spans: Sequence[tuple[int, int]], device: Any = None) -> Any:
    """A ``LongTensor`` of the row indices in ``[(start, stop), ...]``, in order."""
    import torch

    parts = [torch.arange(a, b, device=device) for a, b in spans]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long, device=device)


def is_per_row(value: Any, batch: int) -> bool:
    """Whether ``value`` holds one entry per row of a ``batch``-row call (a broadcast ``[1, ...]`` does not)."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.dim() > 0 and value.shape[0] == batch and batch > 1
    return isinstance(value, (list, tuple)) and len(value) == batch and batch > 1


def take_rows(value: Any, index: Any, batch: int) -> Any:
    """``value``'s rows at ``index`` when it is per-row; anything else (None, broadcast, scalars) unchanged."""
    if not is_per_row(value, batch):
        return value
    if isinstance(value, (list, tuple)):
        picked = [value[i] for i in index.tolist()]
        return type(value)(picked) if isinstance(value, tuple) else picked
    return value.index_select(0, index.to(value.device))


def slice_rows(value: Any, start: int, stop: int, batch: int, name: str = "argument") -> Any:
    """Rows ``start:stop`` of a per-row ``value``; broadcast values unchanged; a clear error for a value whose
    batch dimension does not match the call (so a wrong declaration never slices the wrong thing)."""
    import torch

    if value is None or not isinstance(value, (torch.Tensor, list, tuple)):
        return value
    if isinstance(value, torch.Tensor) and (value.dim() == 0 or value.shape[0] == 1):
        return value
    if is_per_row(value, batch) or (batch == 1 and len(value) == 1):
        return value[start:stop]
    size = tuple(value.shape) if isinstance(value, torch.Tensor) else len(value)
    raise ValueError(f"cannot split {name!r} (a call of {batch} rows) per request: {type(value).__name__} of "
                     f"shape/length {size}; declare only per-row arguments as batch_args / side_inputs")


def concat_rows(outs: Sequence[Any]) -> Any:
    """Join per-part outputs of a split call (tensors, tuples/lists of tensors, or objects with ``.sample``)."""
    import torch

    first = outs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(list(outs))
    if isinstance(first, (tuple, list)):
        joined = [torch.cat(list(parts)) if isinstance(parts[0], torch.Tensor) else parts[0] for parts in zip(*outs)]
        return type(first)(joined)
    if hasattr(first, "sample"):
        first.sample = torch.cat([o.sample for o in outs])
        return first
    raise TypeError(f"cannot join denoiser outputs of type {type(first).__name__}")


__all__ = ["concat_rows", "is_per_row", "slice_rows", "span_index", "take_rows"]

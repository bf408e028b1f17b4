"""Which requests a denoiser call covers, and running only some of them: what every cache backend that decides
per request needs from the typed :class:`~omni_core.forward_context.DenoiseCall`.

A pipeline wraps each denoiser call in ``use_denoise_call(...)``. A backend asks :func:`call_spans` for the
``(group, start, stop)`` row spans of the call (one span with ``group=None`` for a caller that sets no context,
e.g. diffusers' own loop, or a context that does not account for the batch: the call is then one request), and
runs the model on a subset of the requests inside :func:`only_groups`, so code reading ``forward_context().call``
inside the blocks (text key-padding masks, sequence-parallel plans) sees the subset's rows.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator, Sequence

from omni_core.forward_context import DenoiseCall, RowGroup, forward_context, use_forward_context

logger = logging.getLogger("omni_core.cache")


def current_call(batch: int) -> DenoiseCall | None:
    """The typed context of the call in progress when it accounts for exactly ``batch`` rows, else None."""
    call = forward_context().call
    if call is None:
        return None
    if not call.covers(batch):
        logger.debug("denoise call groups of %d rows do not cover the batch of %d; one request assumed",
                     call.batch, batch)
        return None
    return call


def call_spans(batch: int) -> list[tuple[RowGroup | None, int, int]]:
    """``(group, start, stop)`` per request and branch of a ``batch``-row call; ``[(None, 0, batch)]`` when the
    call carries no context that covers it (one request)."""
    call = current_call(batch)
    if call is None:
        return [(None, 0, batch)]
    return call.spans()


def call_key(group: RowGroup | None, default_expert: str) -> tuple[str, str]:
    """``(branch, expert)``: the key of a request's per-denoiser cache state for one call."""
    call = forward_context().call
    expert = (call.expert if call is not None else None) or default_expert
    return (group.branch if group is not None else "cond"), expert


@contextlib.contextmanager
def only_groups(call: DenoiseCall | None, keep: Sequence[int]) -> Iterator[Any]:
    """Run the body as a call of only the groups at indices ``keep`` (per-row context tensors sliced)."""
    if call is None:
        yield None
        return
    with use_forward_context(call=call.select(keep)) as ctx:
        yield ctx


__all__ = ["call_key", "call_spans", "current_call", "only_groups"]

"""Context that model code reads while it is built and while it runs, without threading it through calls.

* ``current_config()`` -- the ``OmniDiffusionConfig`` being loaded (so ``Attention`` layers built inside a
  model see the user's attention choices).
* ``forward_context()`` -- per-forward state: the active sequence-parallel attention strategy (set only
  inside a denoiser region that a parallel plan shards) and the typed :class:`DenoiseCall` of the denoiser
  call in progress (which requests its rows belong to, the CFG branch, the expert, the text key-padding
  mask). Pipelines set the call with :func:`use_denoise_call`; cache backends, sequence-parallel plans and
  attention processors read ``forward_context().call``.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import threading
from typing import Any, Iterator, Sequence

import attrs

_config_var: contextvars.ContextVar[Any] = contextvars.ContextVar("omni_config", default=None)
_forward: contextvars.ContextVar[ForwardContext | None] = contextvars.ContextVar("omni_forward", default=None)

#: the two CFG branches' names
BRANCHES = ("cond", "uncond")


def _check_branch(instance: Any, attribute: Any, value: Any) -> None:
    if not isinstance(value, str) or not value.isidentifier():
        raise ValueError(f"RowGroup.branch must be a name: {', '.join(BRANCHES)} or a model's own guidance row "
                         f"(LTX-2's 'stg', 'modality'), got {value!r}")


@attrs.frozen
class RowGroup:
    """Consecutive rows of one denoiser call that belong to one request and one guidance branch: CFG's ``cond`` and
    ``uncond``, or a model's own (LTX-2's ``stg`` and ``modality`` rows), so a cache keeps each branch's state apart."""

    #: the request's ``StepState`` (None for a caller that is not a pipeline, e.g. a calibration probe)
    state: Any
    rows: int
    branch: str = attrs.field(default="cond", validator=_check_branch)


@attrs.frozen
class DenoiseCall:
    """What one denoiser call covers, typed (it replaced free-form string keys).

    ``groups`` list the requests in row order (a request appears once per branch it runs in this call);
    ``expert`` names the denoiser (a :class:`~omni_core.pipelines.denoiser.DenoiserSpec` name) for models with
    several; ``text_mask`` is the ``[batch, text_len]`` boolean key-padding mask (True = attend) when prompts
    of different lengths share the call, else None.
    """

    groups: tuple[RowGroup, ...] = attrs.field(converter=tuple)
    expert: str | None = None
    text_mask: Any = None

    @property
    def batch(self) -> int:
        return sum(g.rows for g in self.groups)

    @property
    def states(self) -> list[Any]:
        return [g.state for g in self.groups]

    def spans(self) -> list[tuple[RowGroup, int, int]]:
        """``(group, start row, stop row)`` for every group."""
        out, start = [], 0
        for g in self.groups:
            out.append((g, start, start + g.rows))
            start += g.rows
        return out

    def covers(self, batch: int) -> bool:
        """Whether the groups account for exactly ``batch`` rows (a call made with this context)."""
        return bool(self.groups) and self.batch == batch

    def select(self, keep: Sequence[int]) -> DenoiseCall:
        """The context of a call that runs only the groups at indices ``keep`` (per-row tensors sliced)."""
        from omni_core.utils.rows import span_index, take_rows

        spans = self.spans()
        chosen = [spans[i] for i in keep]
        mask = self.text_mask
        if mask is not None:
            mask = take_rows(mask, span_index([(a, b) for _, a, b in chosen], mask.device), self.batch)
        return DenoiseCall(groups=[g for g, _, _ in chosen], expert=self.expert, text_mask=mask)


@attrs.define
class ForwardContext:
    #: object with ``run(layer, q, k, v, attn_mask)``; set inside a sequence-parallel region
    attn_strategy: Any = None
    #: the denoiser call in progress (None outside one, or for a caller that sets none)
    call: DenoiseCall | None = None


def current_config() -> Any:
    return _config_var.get()


@contextlib.contextmanager
def use_config(config: Any) -> Iterator[Any]:
    token = _config_var.set(config)
    try:
        yield config
    finally:
        _config_var.reset(token)


_EMPTY = ForwardContext()

#: what code compiled by torch.compile reads instead of the ContextVar: dynamo cannot trace
#: ``ContextVar.get`` (a graph break in every attention and LoRA layer, each piece compiled and recompiled on
#: its own), but it reads a ``threading.local``'s attribute with a guard evaluated in the calling thread.
#: Kept equal to the ContextVar in this thread by :func:`use_forward_context` and :func:`sync_compiled_view`
#: (which the compiled region's entry calls, so a context copied into a thread is seen too).
_compiled_view = threading.local()


def _compiling() -> bool:
    """Whether dynamo is tracing this call (constant-folded by dynamo; torch is imported only if loaded)."""
    torch = sys.modules.get("torch")
    return torch is not None and torch.compiler.is_compiling()


def forward_context() -> ForwardContext:
    if _compiling():
        return getattr(_compiled_view, "ctx", None) or _EMPTY
    return _forward.get() or _EMPTY


def sync_compiled_view() -> ForwardContext:
    """Make what compiled code reads equal this thread's current context (call eagerly, right before entering
    compiled code); returns it."""
    ctx = _forward.get() or _EMPTY
    _compiled_view.ctx = ctx
    return ctx


@contextlib.contextmanager
def use_forward_context(**fields: Any) -> Iterator[ForwardContext]:
    ctx = attrs.evolve(forward_context(), **fields)
    token = _forward.set(ctx)
    before = getattr(_compiled_view, "ctx", None)
    _compiled_view.ctx = ctx
    try:
        yield ctx
    finally:
        _forward.reset(token)
        _compiled_view.ctx = before


def use_denoise_call(groups: Sequence[RowGroup | tuple], *, expert: str | None = None,
                     text_mask: Any = None) -> contextlib.AbstractContextManager[ForwardContext]:
    """Set the typed context of the denoiser call a pipeline is about to make::

        with use_denoise_call([(state, rows, "cond"), ...], expert="transformer", text_mask=mask):
            out = transformer(...)

    ``groups`` are :class:`RowGroup` or ``(state, rows[, branch])`` tuples, in row order.
    """
    groups = tuple(g if isinstance(g, RowGroup) else RowGroup(*g) for g in groups)
    return use_forward_context(call=DenoiseCall(groups=groups, expert=expert, text_mask=text_mask))

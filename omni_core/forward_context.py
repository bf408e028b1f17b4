"""Context that model code reads while it is built and while it runs, without threading it through calls.

* ``current_config()`` -- the ``OmniDiffusionConfig`` being loaded (so ``Attention`` layers built inside a
  model see the user's attention choices).
* ``forward_context()`` -- per-forward state: the active sequence-parallel attention strategy (set only
  inside a denoiser region that a parallel plan shards) and free-form extras for hooks.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator

import attrs

_config: contextvars.ContextVar[Any] = contextvars.ContextVar("omni_config", default=None)
_forward: contextvars.ContextVar[ForwardContext | None] = contextvars.ContextVar("omni_forward", default=None)


@attrs.define
class ForwardContext:
    #: object with ``run(layer, q, k, v, attn_mask)``; set inside a sequence-parallel region
    attn_strategy: Any = None
    extras: dict = attrs.field(factory=dict)


def current_config() -> Any:
    return _config.get()


@contextlib.contextmanager
def use_config(config: Any) -> Iterator[Any]:
    token = _config.set(config)
    try:
        yield config
    finally:
        _config.reset(token)


_EMPTY = ForwardContext()


def forward_context() -> ForwardContext:
    return _forward.get() or _EMPTY


@contextlib.contextmanager
def use_forward_context(**fields: Any) -> Iterator[ForwardContext]:
    ctx = attrs.evolve(forward_context(), **fields)
    token = _forward.set(ctx)
    try:
        yield ctx
    finally:
        _forward.reset(token)

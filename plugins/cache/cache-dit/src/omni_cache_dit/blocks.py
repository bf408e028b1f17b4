"""A denoiser's blocks as cache-dit sees them, built from its :class:`~omni_core.pipelines.denoiser.DenoiserSpec`.

cache-dit caches a list of blocks whose call follows one of its ``ForwardPattern`` s (fixed names
``hidden_states`` / ``encoder_hidden_states``, fixed return order). A model's blocks take whatever parameters
its spec declares, so this module puts two thin adapters around them, for any model:

* ``SpecStack`` -- the module cache-dit is enabled on (through its own ``BlockAdapter``, not its
  class-name registry): it runs the blocks, each wrapped in a ``_Block`` that translates cache-dit's call
  ``(hidden_states[, encoder_hidden_states], omni_side={...})`` into the block's declared parameters and its declared
  outputs back into cache-dit's order. The stream cache-dit calls ``hidden_states`` (whose Fn residual decides)
  is the spec's ``residual_stream``; a second carried stream, if any, is ``encoder_hidden_states``.
* :func:`install_stand_ins` / :func:`stand_ins_active` -- every block carries a ``cache``-stage hook
  (:data:`STAND_IN`, in :mod:`omni_core.hooks`' registry) that does nothing outside a cached call; while the
  model's own forward runs under :func:`stand_ins_active` (a context variable, so concurrent calls do not
  see each other's), block 0 takes the model's native block call (positional or by name), hands it to the
  stack and returns what the last block returns; every later block passes the streams it gets through. The
  stack runs each real block through the chain *below* that hook (so hooks inside it, e.g. a kernel, still
  run). cache-dit does the same for the models it knows (its
  adapters stand in for the whole block loop), so the model's forward must call its blocks in a plain loop,
  ``for block in self.<blocks_attr>: ... = block(...)``, with nothing between blocks that changes the streams.
  The block list, its length and the blocks' attributes stay as they are (a model may read them).

Outside :func:`stand_ins_active` the hooks pass every call through; after :func:`remove_stand_ins` the model is
exactly as loaded.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator

from omni_core.errors import ConfigError
from omni_core.hooks import STAGES, ModuleHook, add_hook, get_hook, remove_hook

#: the registry name of the stand-in hook on every block of a cached denoiser
STAND_IN = "cache_dit.stand_in"

#: the spec whose cached forward is running in this context (its blocks' stand-ins are active), or None
_ACTIVE: contextvars.ContextVar[Any] = contextvars.ContextVar("omni_cache_dit_active", default=None)


def _streams(spec: Any) -> tuple[str, str | None]:
    """(stream cache-dit calls ``hidden_states``, stream it calls ``encoder_hidden_states`` or None)."""
    others = [name for name in spec.carried if name != spec.residual_stream]
    if len(others) > 1:
        raise ConfigError(f"cache_dit: the {spec.name!r} denoiser's blocks carry {len(spec.carried)} streams "
                          f"{list(spec.carried)}; cache-dit caches at most two (hidden and encoder states)",
                          field="carried")
    return spec.residual_stream, (others[0] if others else None)


def forward_pattern(spec: Any) -> Any:
    """cache-dit's ``ForwardPattern`` of the stack built for ``spec``: Pattern_0 (two streams in and out,
    hidden first) or Pattern_3 (one stream)."""
    from cache_dit import ForwardPattern

    return ForwardPattern.Pattern_0 if _streams(spec)[1] else ForwardPattern.Pattern_3


def build_stack(spec: Any) -> Any:
    """The ``SpecStack`` over ``spec``'s blocks (an ``nn.Module``: cache-dit patches it)."""
    from torch import nn

    hidden, encoder = _streams(spec)
    outputs = spec.block_outputs

    class _Block(nn.Module):
        """One real block called the cache-dit way. (Not ``.block``: cache-dit would check that one's
        signature against its pattern.)"""

        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner
            #: the block's forward below its stand-in hook (``inner.forward`` is the stand-in in a cached call)
            self._own = [_below_stand_in(inner)]

        def forward(self, hidden_states: Any, *encoder_hidden_states: Any, omni_side: dict) -> Any:
            streams = {hidden: hidden_states}
            if encoder is not None:
                streams[encoder] = encoder_hidden_states[0]
            out = self._own[0](**streams, **omni_side)
            if len(outputs) == 1:
                return out
            named = dict(zip(outputs, out))
            return (named[hidden], named[encoder]) if encoder is not None else named[hidden]

    class SpecStack(nn.Module):
        """Runs the blocks in order; cache-dit swaps ``self.blocks`` for its cached blocks while it runs."""

        def __init__(self, blocks: nn.ModuleList) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([_Block(b) for b in blocks])

        def forward(self, hidden_states: Any, *encoder_hidden_states: Any, omni_side: dict) -> Any:
            if encoder is None:
                for block in self.blocks:
                    hidden_states = block(hidden_states, omni_side=omni_side)
                return hidden_states
            (enc,) = encoder_hidden_states
            for block in self.blocks:
                hidden_states, enc = block(hidden_states, enc, omni_side=omni_side)
            return hidden_states, enc

    return SpecStack(spec.blocks)


def _binder(spec: Any) -> Any:
    """``bind(args, kwargs) -> {param: value}`` for the model's native call of one of ``spec``'s blocks."""
    params = spec.block_params

    def bind(args: tuple, kwargs: dict) -> dict:
        if len(args) > len(params):
            raise TypeError(f"cache_dit: the {spec.name!r} denoiser's forward calls a block with {len(args)} "
                            f"positional arguments, but its spec declares block_params {list(params)}")
        bound = dict(zip(params, args))
        dup = sorted(set(bound) & set(kwargs))
        if dup:
            raise TypeError(f"cache_dit: block argument {dup[0]!r} given twice")
        bound.update(kwargs)
        return bound

    return bind


def build_stand_ins(spec: Any, stack: Any) -> tuple[Any, Any]:
    """``(first, rest)``: the forwards blocks take during a cached call. ``first`` (block 0) runs the whole
    cached stack on the model's block call and returns the last block's streams; ``rest`` (every later block)
    returns the streams it is given, so the model's own loop carries block 0's result to its end."""
    hidden, encoder = _streams(spec)
    outputs = spec.block_outputs
    bind = _binder(spec)

    def first(*args: Any, **kwargs: Any) -> Any:
        bound = bind(args, kwargs)
        h = bound.pop(hidden)
        if encoder is None:
            # every other block argument travels as one keyword, which cache-dit passes through untouched (so
            # a side input may have any name, even one of cache-dit's stream names)
            return stack(h, omni_side=bound)
        e = bound.pop(encoder)
        named = dict(zip((hidden, encoder), stack(h, e, omni_side=bound)))
        return tuple(named[name] for name in outputs)

    def rest(*args: Any, **kwargs: Any) -> Any:
        bound = bind(args, kwargs)
        return bound[outputs[0]] if len(outputs) == 1 else tuple(bound[name] for name in outputs)

    return first, rest


def _below_stand_in(block: Any) -> Any:
    """A callable running ``block``'s hook chain below :data:`STAND_IN` (its own forward without the hook)."""
    def call(*args: Any, **kwargs: Any) -> Any:
        hook = get_hook(block, STAND_IN)
        below = hook.fn_ref.original_forward if hook is not None else block.forward
        return below(*args, **kwargs)

    return call


class _StandIn(ModuleHook):
    """``cache``-stage hook on one block: ``stand_in`` while ``spec``'s cached forward runs, else pass-through."""

    order = STAGES["cache"]

    def __init__(self, spec: Any, stand_in: Any) -> None:
        super().__init__()
        self.spec, self.stand_in = spec, stand_in

    def new_forward(self, module: Any, *args: Any, **kwargs: Any) -> Any:
        if _ACTIVE.get() is self.spec:
            return self.stand_in(*args, **kwargs)
        return self.fn_ref.original_forward(*args, **kwargs)


def install_stand_ins(spec: Any, stand_ins: tuple[Any, Any]) -> None:
    """Give block 0 the :data:`STAND_IN` hook with ``stand_ins[0]`` and every later block one with
    ``stand_ins[1]``. The block list itself, its length and the blocks' other attributes stay as they are, so a
    model's forward that reads them still works."""
    first, rest = stand_ins
    for i, block in enumerate(spec.blocks):
        add_hook(block, STAND_IN, _StandIn(spec, first if i == 0 else rest))


def remove_stand_ins(spec: Any) -> None:
    for block in spec.blocks:
        remove_hook(block, STAND_IN, missing_ok=True)


@contextlib.contextmanager
def stand_ins_active(spec: Any) -> Iterator[None]:
    """While the body runs (in this context only), ``spec``'s blocks run their stand-ins."""
    token = _ACTIVE.set(spec)
    try:
        yield
    finally:
        _ACTIVE.reset(token)

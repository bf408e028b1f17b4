"""A denoiser's blocks as cache-dit sees them, built from its :class:`~omni_core.pipelines.denoiser.DenoiserSpec`.

cache-dit caches a list of blocks whose call follows one of its ``ForwardPattern`` s (fixed names
``hidden_states`` / ``encoder_hidden_states``, fixed return order). A model's blocks take whatever parameters
its spec declares, so this module puts two thin adapters around them, for any model:

* ``SpecStack`` -- the module cache-dit is enabled on (through its own ``BlockAdapter``, not its
  class-name registry): it runs the blocks, each wrapped in a ``_Block`` that translates cache-dit's call
  ``(hidden_states[, encoder_hidden_states], omni_side={...})`` into the block's declared parameters and its declared
  outputs back into cache-dit's order. The stream cache-dit calls ``hidden_states`` (whose Fn residual decides)
  is the spec's ``residual_stream``; a second carried stream, if any, is ``encoder_hidden_states``.
* :func:`patched_blocks` -- while the model's own forward runs, its block list (``spec.blocks_attr``) is
  one ``_Entry`` that takes the model's native block call (positional or by name), hands it to the
  stack, and returns what a block returns. This is what cache-dit itself does for the models it knows
  (its adapters swap the block list during the forward), so the model's forward must call its blocks in a
  plain loop, ``for block in self.<blocks_attr>: ... = block(...)``.

The model's blocks are never modified; outside :func:`patched_blocks` the model is exactly as loaded.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from omni_core.errors import ConfigError


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

        def forward(self, hidden_states: Any, *encoder_hidden_states: Any, omni_side: dict) -> Any:
            streams = {hidden: hidden_states}
            if encoder is not None:
                streams[encoder] = encoder_hidden_states[0]
            out = self.inner(**streams, **omni_side)
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


def build_entry(spec: Any, stack: Any) -> Any:
    """The one-element block list that stands in for the model's blocks during a cached forward."""
    from torch import nn

    hidden, encoder = _streams(spec)
    params, outputs = spec.block_params, spec.block_outputs

    class _Entry(nn.Module):
        """The model's native block call -> one call of the cached stack -> the block's declared return."""

        def __init__(self) -> None:
            super().__init__()
            self._stack = [stack]  # not a submodule: the stack is cache-dit's, this is only a call site

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            if len(args) > len(params):
                raise TypeError(f"cache_dit: the {spec.name!r} denoiser's forward calls a block with {len(args)} "
                                f"positional arguments, but its spec declares block_params {list(params)}")
            bound = dict(zip(params, args))
            dup = sorted(set(bound) & set(kwargs))
            if dup:
                raise TypeError(f"cache_dit: block argument {dup[0]!r} given twice")
            bound.update(kwargs)
            h = bound.pop(hidden)
            e = bound.pop(encoder) if encoder is not None else None
            # every other block argument travels as one keyword, which cache-dit passes through untouched (so
            # a side input may have any name, even one of cache-dit's stream names)
            out = self._stack[0](h, e, omni_side=bound) if encoder is not None else self._stack[0](h, omni_side=bound)
            if encoder is None:
                return out
            named = {hidden: out[0], encoder: out[1]}
            return tuple(named[name] for name in outputs)

    return nn.ModuleList([_Entry()])


@contextlib.contextmanager
def patched_blocks(spec: Any, entry: Any) -> Iterator[None]:
    """While the body runs, the model's ``blocks_attr`` is ``entry`` (restored after, even on an error)."""
    module, name = spec.module, spec.blocks_attr
    original = getattr(module, name)
    setattr(module, name, entry)
    try:
        yield
    finally:
        setattr(module, name, original)

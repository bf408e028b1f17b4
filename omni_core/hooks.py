"""One hook registry per module: the only place in Omni that changes how a module's ``forward`` runs.

Caches, LoRA's per-row layers, compile and the VAE's single-frame convolutions each used to assign
``module.forward`` (or a private torch attribute) themselves, so whether two of them stacked depended on which
ran first, and removing one could drop another. Now each is a named :class:`ModuleHook` in the module's
:class:`HookRegistry`, at a declared ``order`` (an integer stage; see :data:`STAGES`): the chain always runs
in ascending ``order`` from the outside in (ties broken by name), whatever order the hooks were added in, and
removing a hook by name rebuilds the chain of the others and, once none is left, restores the module exactly
(its ``__dict__`` as before the first hook).

What is reused from diffusers (``diffusers.hooks.hooks``): :class:`ModuleHook` *is* a diffusers ``ModelHook``
(``pre_forward(module, *args, **kwargs) -> (args, kwargs)``, ``post_forward(module, output)``, optional
``new_forward(module, *args, **kwargs)`` that calls ``self.fn_ref.original_forward`` for the rest of the
chain, ``initialize_hook``/``deinitalize_hook``), and each link of the chain is a diffusers
``HookFunctionReference``, so a hook written for diffusers' registry runs here unchanged. What is not reused is
diffusers' ``HookRegistry`` itself, because it cannot do three things this one must:

* **declared order** -- diffusers appends every hook outside the previous ones (order = who registered
  first), and a hook cannot be placed inside existing ones; here the chain is rebuilt from the ``order`` s
  on every change;
* **exact restoration** -- removing diffusers' last hook leaves ``forward`` as an instance attribute (and
  its ``_diffusers_hook`` registry) on the module; here the module's ``__dict__`` gets back exactly its
  previous ``forward`` entry (or none);
* **coexistence** -- diffusers' own offload / group-offload / cache hooks live in ``module._diffusers_hook``;
  a separate registry (``module._omni_hooks``) keeps Omni's chain from being reordered or removed by
  diffusers (e.g. ``load_lora_weights`` stripping offload hooks) and vice versa. The chain calls whatever
  ``forward`` the module had when its first Omni hook was added.

Per-request state never lives on the module or the hook: a hook reads the rows of the call in progress from
the :class:`~omni_core.forward_context.DenoiseCall` (``forward_context().call``) and keeps each request's
state in that request's ``StepState`` through :meth:`ModuleHook.request_state`.

Example (a hook that scales a block's output, placed as a cache would be)::

    from omni_core.hooks import ModuleHook, add_hook, remove_hook, STAGES

    class Scale(ModuleHook):
        order = STAGES["cache"]
        def post_forward(self, module, output):
            return output * 2

    add_hook(block, "my_plugin.scale", Scale())
    ...
    remove_hook(block, "my_plugin.scale")  # block is exactly as before
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

from diffusers.hooks.hooks import HookFunctionReference, ModelHook

from omni_core.forward_context import DenoiseCall, RowGroup, forward_context

#: the stages features stand at, outermost (runs first on the way in, last on the way out) to innermost.
#: A hook may take any integer; these name the places the core's own features take.
STAGES: dict[str, int] = {
    "instrument": 100,  # timing, tracing: sees the call exactly as the caller made it
    "cache": 200,  # skip or reuse work (tea_cache, cache_dit): decides before anything below runs
    "lora": 300,  # per-row adapter deltas (replace the layer's forward)
    "offload": 400,  # move weights in before, out after
    "compile": 500,  # the compiled region: everything below it is traced
    "kernel": 600,  # a faster computation of the module's own forward (e.g. the VAE's single-frame conv)
}

_ATTR = "_omni_hooks"
_MISSING = object()


#: the state of rows that belong to no request (a caller that runs the denoiser itself, with no DenoiseCall): one
#: run at a time, forgotten when the next request or run begins (:func:`forget_standalone_state`)
_STANDALONE: dict = {}


def state_store(state: Any) -> dict:
    """Where per-request hook state lives: the request's ``StepState.hook_state``, or, for rows with no request
    (``state`` None), the process's :func:`standalone_state`. One store for every hook, caches included."""
    store = getattr(state, "hook_state", None) if state is not None else None
    return _STANDALONE if store is None else store


def request_state(group: RowGroup | None, key: Any, factory: Callable[[], Any]) -> Any:
    """The state ``key`` of the request that the rows ``group`` belong to, made with ``factory`` on first use and
    kept in that request's ``StepState.hook_state`` (:func:`state_store`). Why here, once: two caches each kept a
    store of their own for the rows of a caller with no request; the core now keeps that one as well."""
    return _get_or_make(state_store(getattr(group, "state", None) if group is not None else None), key, factory)


def standalone_state() -> dict:
    """The state of rows that belong to no request (see :func:`request_state`)."""
    return _STANDALONE


def forget_standalone_state() -> None:
    """A new request or run begins: rows with no request start afresh (``CacheBackend.begin_request`` calls it)."""
    _STANDALONE.clear()


def _get_or_make(store: dict, key: Any, factory: Callable[[], Any]) -> Any:
    value = store.get(key, _MISSING)
    if value is _MISSING:
        value = store[key] = factory()
    return value


class ModuleHook(ModelHook):
    """A diffusers ``ModelHook`` with a declared place in the chain (``order``, lower = outer).

    ``order`` is a class attribute; pass ``order=`` to :func:`add_hook` to override it for one registration.
    """

    order: int = STAGES["kernel"]

    def request_state(self, group: RowGroup | None, key: Any, factory: Callable[[], Any],
                      fallback: dict | None = None) -> Any:
        """:func:`request_state` (``fallback``, a store of the hook's owner for rows with no request, is the
        older spelling: without it those rows share the process's :func:`standalone_state`)."""
        if fallback is not None and (group is None or getattr(group, "state", None) is None):
            return _get_or_make(fallback, key, factory)
        return request_state(group, key, factory)

    @staticmethod
    def current_call(batch: int | None = None) -> DenoiseCall | None:
        """The :class:`DenoiseCall` in progress (None outside one); with ``batch``, only if it covers exactly
        that many rows."""
        call = forward_context().call
        if call is not None and batch is not None and not call.covers(batch):
            return None
        return call


class FunctionHook(ModuleHook):
    """A hook made from one function: its ``new_forward`` is ``fn(below, *args, **kwargs)``, where ``below``
    runs the rest of the chain (the hooks inside this one, then the module's own forward). ``fn`` decides
    whether, how often and with which arguments ``below`` runs; ``order`` is its place (default: the
    ``cache`` stage). The function is kept as ``.fn``.

    Example (a cache-stage hook that skips the module for an all-zero input)::

        def skip_zeros(below, x, *args, **kwargs):
            return x if not x.any() else below(x, *args, **kwargs)

        add_hook(block, "my_plugin.skip", FunctionHook(skip_zeros))
    """

    order = STAGES["cache"]

    def __init__(self, fn: Callable[..., Any], *, order: int | None = None) -> None:
        super().__init__()
        self.fn = fn
        if order is not None:
            self.order = int(order)

    def new_forward(self, module: Any, *args: Any, **kwargs: Any) -> Any:
        return self.fn(self.fn_ref.original_forward, *args, **kwargs)

    def __repr__(self) -> str:
        return f"FunctionHook({getattr(self.fn, '__qualname__', self.fn)!r}, order={self.order})"


def _is_default(hook: Any, method: str) -> bool:
    return getattr(type(hook), method) is getattr(ModelHook, method)


def _link(module: Any, hook: Any, below: Callable) -> Callable:
    """One link of the chain: ``hook`` around ``below`` (the rest of the chain towards the module)."""
    ref = HookFunctionReference()
    ref.pre_forward, ref.post_forward, ref.forward = hook.pre_forward, hook.post_forward, below
    if hasattr(hook, "new_forward"):
        ref.original_forward = below
        ref.forward = functools.partial(hook.new_forward, module)
    hook.fn_ref = ref
    run = ref.forward
    pre = None if _is_default(hook, "pre_forward") else hook.pre_forward
    post = None if _is_default(hook, "post_forward") else hook.post_forward
    if pre is None and post is None:  # new_forward only (or nothing): no extra Python frame per call
        return run

    def call(*args: Any, **kwargs: Any) -> Any:
        if pre is not None:
            args, kwargs = pre(module, *args, **kwargs)
        out = run(*args, **kwargs)
        return post(module, out) if post is not None else out

    return call


class HookRegistry:
    """The named hooks of one module, run in declared order. Get it with :meth:`of`."""

    def __init__(self, module: Any) -> None:
        self.module = module
        #: name -> (order, hook)
        self.hooks: dict[str, tuple[int, Any]] = {}
        #: the module's own ``forward`` entry in its ``__dict__`` before the first hook (or _MISSING)
        self._saved: Any = _MISSING
        #: what the chain ends in: the forward the module had when the first hook was added
        self._base: Callable | None = None
        self._chain: Callable | None = None
        self._dispatch: Callable | None = None

    @classmethod
    def of(cls, module: Any, create: bool = True) -> HookRegistry | None:
        """``module``'s registry (made on first use when ``create``; else None if it has none)."""
        registry = module.__dict__.get(_ATTR)
        if registry is None and create:
            registry = cls(module)
            object.__setattr__(module, _ATTR, registry)  # not a submodule, not a parameter
        return registry

    # ------------------------------------------------------------------ queries
    def names(self) -> list[str]:
        """Hook names in the order the chain runs them (outermost first)."""
        return [name for name, _ in sorted(self.hooks.items(), key=lambda kv: (kv[1][0], kv[0]))]

    def get(self, name: str) -> Any:
        entry = self.hooks.get(name)
        return entry[1] if entry is not None else None

    @property
    def base(self) -> Callable | None:
        """The forward the chain ends in (the module's own when no one else wrapped it); None without hooks."""
        return self._base

    def __contains__(self, name: str) -> bool:
        return name in self.hooks

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        for name in self.names():
            yield name, self.hooks[name][1]

    def __repr__(self) -> str:
        inner = ", ".join(f"{name}@{self.hooks[name][0]}" for name in self.names())
        return f"HookRegistry({type(self.module).__name__}: {inner})"

    # ------------------------------------------------------------------ changes
    def add(self, name: str, hook: Any, *, order: int | None = None) -> Any:
        """Add ``hook`` as ``name`` at ``order`` (default: the hook's own ``order``); returns the hook. A name
        already present is an error (remove it first)."""
        if name in self.hooks:
            raise ValueError(f"a hook named {name!r} is already on this {type(self.module).__name__} "
                             f"({self!r}); remove it first")
        if order is None:
            order = getattr(hook, "order", STAGES["kernel"])
        module = self.module
        if self._dispatch is None:  # first hook (again): the chain ends in the forward the module has now
            self._saved = module.__dict__.get("forward", _MISSING)
            self._base = module.forward
        returned = hook.initialize_hook(module)
        if returned is not None and returned is not module:
            raise ValueError(f"hook {name!r}: initialize_hook must return the module it was given")
        self.hooks[name] = (int(order), hook)
        self._rebuild()
        return hook

    def remove(self, name: str) -> Any:
        """Remove the hook ``name`` (a missing name is an error); returns it. The others keep running in
        their order; with none left the module's ``forward`` is exactly what it was before the first."""
        if name not in self.hooks:
            raise KeyError(f"no hook named {name!r} on this {type(self.module).__name__} ({self!r})")
        _, hook = self.hooks.pop(name)
        hook.deinitalize_hook(self.module)  # (sic: diffusers' spelling)
        hook.fn_ref = None
        self._rebuild()
        return hook

    def clear(self) -> None:
        for name in reversed(self.names()):
            self.remove(name)

    def call_below(self, name: str) -> Callable:
        """A callable running the chain *below* hook ``name`` (the hooks inside it, then the module's own
        forward), looked up at call time so later changes to the chain are followed."""
        def call(*args: Any, **kwargs: Any) -> Any:
            hook = self.get(name)
            if hook is None or hook.fn_ref is None:
                raise RuntimeError(f"hook {name!r} is no longer on this {type(self.module).__name__}")
            ref = hook.fn_ref
            below = ref.original_forward if ref.original_forward is not None else ref.forward
            return below(*args, **kwargs)

        return call

    def detach(self) -> bool:
        """Take the chain out of the module (its ``forward`` is what it was before the first hook) while another
        library rewrites that ``forward`` (see :func:`hooks_set_aside`); False if someone wrapped the chain since
        (their wrapper calls it: nothing to do). The hooks stay registered; :meth:`attach` puts them back."""
        module = self.module
        if self._dispatch is None or module.__dict__.get("forward") is not self._dispatch:
            return False
        if self._saved is _MISSING:
            del module.__dict__["forward"]
        else:
            module.__dict__["forward"] = self._saved
        return True

    def attach(self) -> None:
        """Wrap the chain around whatever ``forward`` the module has now (after :meth:`detach`)."""
        module = self.module
        self._saved = module.__dict__.get("forward", _MISSING)
        self._base = module.forward
        self._rebuild()
        module.__dict__["forward"] = self._dispatch

    def _rebuild(self) -> None:
        module = self.module
        if not self.hooks:
            self._chain = None
            if module.__dict__.get("forward") is self._dispatch:  # nobody wrapped us since: restore exactly
                if self._saved is _MISSING:
                    del module.__dict__["forward"]
                else:
                    module.__dict__["forward"] = self._saved
                module.__dict__.pop(_ATTR, None)
                self._dispatch = self._base = None
                self._saved = _MISSING
            # else someone (e.g. diffusers' own registry) wrapped our dispatcher: leave it, as a pass-through
            return
        chain = self._base
        for name in reversed(self.names()):
            chain = _link(module, self.hooks[name][1], chain)
        self._chain = chain
        if self._dispatch is None:
            base = self._base

            def dispatch(*args: Any, **kwargs: Any) -> Any:
                run = self._chain
                return (run if run is not None else self._base)(*args, **kwargs)

            functools.update_wrapper(dispatch, base)  # inspect.signature sees the module's own forward
            self._dispatch = dispatch
            module.__dict__["forward"] = dispatch


@contextlib.contextmanager
def hooks_set_aside(*roots: Any) -> Iterator[None]:
    """Omni's chains on ``roots`` and their submodules stand aside while the body runs, then wrap whatever
    ``forward`` each module has afterwards. For library calls that reassign ``forward``: diffusers'
    ``load_lora_weights`` / ``delete_adapters`` remove and re-apply group offloading, and diffusers' registry
    removes its hooks by assigning the forward it saw first -- which would drop a chain added after them."""
    detached = []
    for root in roots:
        for module in root.modules():
            registry = HookRegistry.of(module, create=False)
            if registry is not None and registry.detach():
                detached.append(registry)
    try:
        yield
    finally:
        for registry in detached:
            registry.attach()


def add_hook(module: Any, name: str, hook: Any, *, order: int | None = None) -> Any:
    """Add ``hook`` to ``module``'s registry as ``name`` (see :meth:`HookRegistry.add`)."""
    return HookRegistry.of(module).add(name, hook, order=order)


def remove_hook(module: Any, name: str, *, missing_ok: bool = False) -> Any:
    """Remove the hook ``name`` from ``module`` (see :meth:`HookRegistry.remove`); with ``missing_ok`` a
    missing hook returns None."""
    registry = HookRegistry.of(module, create=False)
    if registry is None or name not in registry:
        if missing_ok:
            return None
        raise KeyError(f"no hook named {name!r} on this {type(module).__name__}")
    return registry.remove(name)


def get_hook(module: Any, name: str) -> Any:
    """The hook ``name`` on ``module``, or None."""
    registry = HookRegistry.of(module, create=False)
    return registry.get(name) if registry is not None else None


def hook_names(module: Any) -> list[str]:
    """Names of ``module``'s hooks in the order they run (outermost first); empty without any."""
    registry = HookRegistry.of(module, create=False)
    return registry.names() if registry is not None else []


__all__ = ["STAGES", "FunctionHook", "HookRegistry", "ModuleHook", "add_hook", "get_hook", "hook_names", "hooks_set_aside",
           "remove_hook"]

"""``compile=True``: regional ``torch.compile`` of each denoiser's repeated blocks, with dynamic shapes.

Compiling one block class instead of the whole denoiser compiles once for all blocks (they share code), costs a
fraction of a full compile and keeps Python-level inputs (Qwen's ``img_shapes`` list) out of the guards, so a
step wave's changing batch size recompiles once (dynamo specialises size 1 first) and then stays dynamic
(cpu-notes §13). Every block of the :class:`~omni_core.pipelines.denoiser.DenoiserSpec`'s ``blocks_attr`` gets
a ``compile``-stage hook (:data:`COMPILE_HOOK` in :mod:`omni_core.hooks`' registry), so every model gets it by
declaration. The hook runs ``torch.compile(<block class>.forward)`` -- one compiled function per block class,
called with the block, so dynamo keeps one cache entry for all blocks (what diffusers' ``compile_repeated_blocks``
gets from ``nn.Module.compile``) -- or, when other hooks sit below it on a block, the compiled rest of that
block's chain. It does not use ``nn.Module.compile``: that compiles ``_call_impl`` outside every hook and can
only be undone through a private attribute of torch's ``nn.Module``, which the fall-back below needs. Hooks above
the ``compile`` stage (a cache's block hooks) run eagerly around the compiled region.

Compilation happens at the first call -- the start-up warm-up. If a compiled call raises and the same call
succeeds eagerly, compilation is at fault: every block returns to eager and a warning names the reason.

``OMNI_COMPILE_BACKEND`` (environment, default ``inductor``) picks torch.compile's backend, as torch's own
debugging guides do with ``backend=``: ``aot_eager`` traces exactly what inductor would get (dynamo's graph
capture, guards, graph breaks around hooks, AOTAutograd with tensor subclasses) without generating kernels --
what the combination matrix runs in CI, where a cold inductor build of every graph costs minutes.
"""

from __future__ import annotations

import logging
from typing import Any

from omni_core.forward_context import sync_compiled_view
from omni_core.hooks import STAGES, HookRegistry, ModuleHook, add_hook

logger = logging.getLogger("omni_core.optimize")

#: the registry name of the compile hook on every denoiser block
COMPILE_HOOK = "compile"


class RegionalCompile:
    """The compiled blocks of one pipeline and the switch back to eager."""

    def __init__(self, blocks: list[Any], *, dynamic: bool = True, backend: str | None = None) -> None:
        import os

        self.blocks = blocks
        self.dynamic = dynamic
        self.backend = backend or os.environ.get("OMNI_COMPILE_BACKEND") or "inductor"
        self.failed: str | None = None
        #: block class -> torch.compile(class.forward), shared by every block of the class
        self._by_class: dict[type, Any] = {}
        #: called eagerly with the block's first tensor input right before every compiled call: per-call Python
        #: state (the LoRA manager's row scales) becomes tensors there, so the compiled code reads data, not
        #: Python values dynamo would guard on (and recompile for on every new value)
        self.before_call: list[Any] = []
        #: compiled block calls that returned so far (:func:`compile_metrics`)
        self.calls = 0

    def fall_back(self, exc: BaseException) -> None:
        """Every block runs eagerly from now on (each hook reads ``failed``)."""
        self.failed = _reason(exc)
        logger.warning("compile=True: the compiled denoiser blocks failed (%s); running them eagerly", self.failed)

    def compiled_class_forward(self, cls: type) -> Any:
        import torch

        fn = self._by_class.get(cls)
        if fn is None:
            fn = self._by_class[cls] = torch.compile(cls.forward, dynamic=self.dynamic, backend=self.backend)
        return fn


def _reason(exc: BaseException) -> str:
    """``Type: message`` of ``exc`` and of what caused it (dynamo wraps the backend's error: "backend='inductor'
    raised:" says nothing without the inner one)."""
    parts, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        parts.append(f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": "))
        exc = exc.__cause__ or exc.__context__
    return " <- ".join(parts)


class CompiledBlock(ModuleHook):
    """``compile``-stage hook: the rest of the block's chain, compiled, with the eager fall-back."""

    order = STAGES["compile"]

    def __init__(self, region: RegionalCompile) -> None:
        super().__init__()
        self.region = region
        #: (the callable below this hook, its compiled form)
        self._target: tuple[Any, Any] | None = None

    def _compiled(self, block: Any, below: Any) -> Any:
        import functools

        import torch

        target = self._target
        if target is not None and target[0] is below:
            return target[1]
        base = HookRegistry.of(block).base
        if (below is base and getattr(base, "__self__", None) is block
                and getattr(base, "__func__", None) is type(block).forward):
            fn = functools.partial(self.region.compiled_class_forward(type(block)), block)
        else:  # other hooks (or a foreign forward) below: compile what is there, for this block alone
            fn = torch.compile(below, dynamic=self.region.dynamic, backend=self.region.backend)
        self._target = (below, fn)
        return fn

    def new_forward(self, block: Any, *args: Any, **kwargs: Any) -> Any:
        below = self.fn_ref.original_forward
        if self.region.failed is not None:
            return below(*args, **kwargs)
        compiled = self._compiled(block, below)
        sync_compiled_view()
        if self.region.before_call:
            first = next((a for a in (*args, *kwargs.values()) if hasattr(a, "shape")), None)
            for fn in self.region.before_call:
                fn(first)
        try:
            out = compiled(*args, **kwargs)
            self.region.calls += 1
            return out
        except Exception as exc:  # noqa: BLE001 - decide below whether compilation is to blame
            out = below(*args, **kwargs)  # raises (the model's own error) if eager fails too
            self.region.fall_back(exc)
            return out


def compile_metrics(pipeline: Any) -> dict[str, Any]:
    """What a request's output metrics say of compile=True (``{}`` without it): the compiled block calls that
    returned in this worker process so far and why it fell back to eager (None if it did not). Outputs come
    from the workers, so this is how a multi-rank run shows that its ranks really ran compiled code."""
    region = getattr(pipeline, "omni_compile", None)
    if not isinstance(region, RegionalCompile):
        return {}
    return {"compiled_block_calls": region.calls, "compile_failed": region.failed}


def compile_denoisers(pipeline: Any, *, dynamic: bool = True) -> dict[str, Any]:
    """Compile every declared denoiser's blocks in place; returns what was done (for the start-up log)."""
    from omni_core.utils.denoisers import repeated_blocks

    blocks, names = [], []
    for name, region_blocks in repeated_blocks(pipeline):
        blocks += region_blocks
        names.append(name)
    # CPU lanes run a wave's requests concurrently with fewer torch threads each; dynamo guards on the thread
    # count, so every lane change would recompile (and two lanes compile the same frame at once): one call per wave
    pipeline.concurrent_calls_safe = False
    region = RegionalCompile(blocks, dynamic=dynamic)
    for block in blocks:
        add_hook(block, COMPILE_HOOK, CompiledBlock(region))
    pipeline.omni_compile = region  # tests and stats read region.failed
    return {"compile": "regional", "blocks": len(blocks), "regions": names, "dynamic": dynamic,
            "backend": region.backend}

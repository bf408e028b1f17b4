"""The worker side of LoRA: loaded adapters (an LRU cache, pinned while in use) and per-row application.

Loading is diffusers' own: ``pipe.load_lora_weights(state_dict, adapter_name=...)`` puts peft LoRA layers on
the denoiser. What neither library does is run requests with *different* adapters and scales in one batched
call (diffusers applies the active adapters to every row; peft's ``adapter_names`` routes rows but with one
scale per adapter), so each peft LoRA layer gets the :class:`PerRowLora` hook (``lora``-stage, named
:data:`PER_ROW_HOOK`, in :mod:`omni_core.hooks`' registry) whose ``new_forward`` replaces peft's: the base
layer on all rows, then for each adapter present in the call ONE ``B(A(x[rows]))`` over its rows, times each
row's own scale (a segmented computation, as multi-LoRA LLM servers do). Weights are never merged. The rows
come from the :class:`~omni_core.forward_context.DenoiseCall` the pipeline sets around every denoiser call
(requests x CFG branches x outputs, exactly as the batch is built; a cache backend that runs a subset of rows
sets the subset's call), so the layout is declared by data and every diffusers-based pipeline gets it.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
from typing import Any

from omni_core.forward_context import forward_context
from omni_core.hooks import STAGES, ModuleHook, add_hook, get_hook, hooks_set_aside
from omni_core.lora.files import resolve_lora_path

logger = logging.getLogger("omni_core.lora")

#: the registry name of the per-row hook on every peft LoRA layer of a denoiser
PER_ROW_HOOK = "lora.per_row"


class LoraManager:
    """Adapters of one worker's pipeline: ``acquire`` when a request's state is made, ``release`` when it ends."""

    def __init__(self, pipeline: Any, config: Any) -> None:
        self.pipeline = pipeline
        self.config = config
        #: adapter file -> peft adapter name, least recently used first
        self.loaded: collections.OrderedDict[str, str] = collections.OrderedDict()
        #: peft adapter name -> ids of the requests using it (pinned while non-empty)
        self.users: dict[str, set[str]] = {}
        #: request id -> (peft adapter name, scale)
        self.active: dict[str, tuple[str, float]] = {}
        self._count = 0
        self._lock = threading.Lock()
        self._plan: tuple[Any, int, list] | None = None
        self._gathered: dict = {}
        self.patched = 0
        #: adapter name -> ``[batch]`` float32 row scales (0 = not applied) of the compiled block call about to
        #: run, made by :meth:`prepare_compiled` (empty when no row of the call has an adapter)
        self.compiled_rows: dict[str, Any] = {}
        region = getattr(pipeline, "omni_compile", None)
        if region is not None:  # compile=True: the compiled blocks' entry prepares the rows (see PerRowLora)
            region.before_call.append(self.prepare_compiled)

    @staticmethod
    def serves(pipeline: Any) -> bool:
        """Whether ``pipeline`` takes adapters: a diffusers-based one whose diffusers pipeline has the LoRA loader,
        or whose denoisers have diffusers' PEFT mixin (a family diffusers ships no loader for)."""
        pipe = getattr(pipeline, "pipe", None)
        if not hasattr(pipeline, "experts") or pipe is None:
            return False
        if hasattr(pipe, "load_lora_weights"):
            return True
        names = [n for n in getattr(pipeline, "denoiser_names", ("transformer",)) if getattr(pipe, n, None) is not None]
        return bool(names) and all(hasattr(getattr(pipe, n), "load_lora_adapter") for n in names)

    @property
    def diffusers_pipe(self) -> Any:
        return self.pipeline.pipe

    def preload(self) -> None:
        """Load the configured ``loras`` (up to ``max_loras``; the rest load when first asked for)."""
        for name in list(self.config.loras)[: self.config.max_loras]:
            self._ensure_loaded(resolve_lora_path(name, self.config.loras, "loras"))

    def replace(self, name: str, path: str) -> None:
        """Point the engine's adapter ``name`` (one of ``loras``) at the adapter file ``path``, loading it now: a
        file diffusers cannot load raises here and ``name`` keeps its adapter (LoRA-only weight sync). Requests
        running keep the adapter they pinned; the old one is unloaded once unused (LRU)."""
        with self._lock:
            self._ensure_loaded(path)
            self.config.loras[name] = path

    # ------------------------------------------------------------------ cache
    def acquire(self, request: Any) -> None:
        """Pin the adapter ``request`` names (loading it if needed) for as long as the request runs."""
        params = request.sampling_params
        if params.lora is None or request.request_id in self.active:
            return
        path = resolve_lora_path(params.lora, self.config.loras)
        with self._lock:
            name = self._ensure_loaded(path)
            self.loaded.move_to_end(path)
            self.users.setdefault(name, set()).add(request.request_id)
            self.active[request.request_id] = (name, float(params.lora_scale))

    def release(self, request_id: str) -> None:
        with self._lock:
            entry = self.active.pop(request_id, None)
            if entry is not None:
                self.users.get(entry[0], set()).discard(request_id)
                self._evict(self.config.max_loras)

    def _evict(self, limit: int) -> None:
        """Unload least recently used adapters no running request uses until at most ``limit`` are loaded (all
        in use: the cache stays above its size until one is released)."""
        for path, name in list(self.loaded.items()):
            if len(self.loaded) <= limit:
                return
            if not self.users.get(name):
                with self._components_set_aside():
                    self._delete_adapter(name)
                del self.loaded[path]
                self.users.pop(name, None)
                logger.info("LoRA %s unloaded (LRU, max_loras=%d)", path, self.config.max_loras)

    def _ensure_loaded(self, path: str) -> str:
        if path in self.loaded:
            return self.loaded[path]
        self._evict(self.config.max_loras - 1)
        self._count += 1
        name = f"omni_lora_{self._count}"
        import torch

        # by folder + file name, exactly as a user calls diffusers (its metadata, e.g. lora_alpha, is read too);
        # outside inference mode: the runner calls this inside it, and diffusers' state_dict() of a torchao
        # (int8) model detaches its weights, which a tensor subclass cannot do there ("Cannot set
        # version_counter for inference tensor")
        with self._components_set_aside(), torch.inference_mode(False):
            self._load_adapter(path, name)
        self.loaded[path] = name
        self._patch_layers()
        logger.info("LoRA %s loaded as %s", path, name)
        return name

    def _load_adapter(self, path: str, name: str) -> None:
        """diffusers' pipeline loader where the family has one; else each denoiser's own PEFT mixin
        (``load_lora_adapter``) with its part of the file in diffusers' naming (HunyuanVideo 1.5)."""
        pipe = self.diffusers_pipe
        if hasattr(pipe, "load_lora_weights"):
            pipe.load_lora_weights(os.path.dirname(path), weight_name=os.path.basename(path), adapter_name=name)
            return
        from omni_core.lora.files import load_state_dict

        state_dict, metadata = load_state_dict(path, type(self.pipeline))
        for component in self._denoiser_components():
            part = {k[len(component) + 1:]: v for k, v in state_dict.items() if k.startswith(f"{component}.")}
            if part:
                getattr(pipe, component).load_lora_adapter(part, prefix=None, adapter_name=name, metadata=metadata)

    def _delete_adapter(self, name: str) -> None:
        pipe = self.diffusers_pipe
        if hasattr(pipe, "delete_adapters"):
            pipe.delete_adapters(name)
            return
        for component in self._denoiser_components():
            module = getattr(pipe, component)
            if name in getattr(module, "peft_config", {}):
                module.delete_adapters(name)

    def _denoiser_components(self) -> list[str]:
        names = getattr(self.pipeline, "denoiser_names", ("transformer",))
        return [n for n in names if getattr(self.diffusers_pipe, n, None) is not None]

    def _components_set_aside(self):
        """diffusers re-applies group offloading around adapter loads and deletes by reassigning ``forward``;
        our hooks (caches, instrumentation) on those modules stand aside meanwhile and wrap the result."""
        import torch

        return hooks_set_aside(*(m for m in self.diffusers_pipe.components.values()
                                 if isinstance(m, torch.nn.Module)))

    def _patch_layers(self) -> None:
        from peft.tuners.lora import LoraLayer

        for module in self.pipeline.experts.values():
            for layer in module.modules():
                if isinstance(layer, LoraLayer) and get_hook(layer, PER_ROW_HOOK) is None:
                    layer.eval()  # peft builds its layers in training mode; this is inference (no dropout)
                    add_hook(layer, PER_ROW_HOOK, PerRowLora(self))
                    self.patched += 1

    # ------------------------------------------------------------------ per-row layout
    def plan(self, batch: int) -> list:
        """``[(adapter, [(start, stop, scale), ...]), ...]`` for the denoiser call in progress: each adapter's
        spans of rows (adjacent rows with the same adapter and scale merged; a request's CFG branches are two
        spans). Empty when no row has an adapter. Computed once per call (memoised on the call object) and
        shared by every layer."""
        call = forward_context().call
        cached = self._plan
        if cached is not None and cached[0] is call and cached[1] == batch:
            return cached[2]
        plan = self._build_plan(call, batch)
        self._plan = (call, batch, plan)
        return plan

    def prepare_compiled(self, x: Any) -> None:
        """Turn the current call's :meth:`plan` into per-row scale tensors for code under torch.compile (run
        eagerly before each compiled block call, with the block's first input: rows on dim 0). One tensor per
        loaded adapter, in name order, so the compiled graph depends only on which adapters are loaded and
        whether any row uses one -- not on the row layout, which changes with every wave."""
        if x is None:
            self.compiled_rows = {}
            return
        plan = self.plan(x.shape[0])
        if not plan:
            self.compiled_rows = {}
            return
        import torch

        scales = {name: [0.0] * x.shape[0] for name in sorted(self.loaded.values())}
        for name, spans in plan:
            for start, stop, scale in spans:
                scales[name][start:stop] = [scale] * (stop - start)
        self.compiled_rows = {name: torch.tensor(v, dtype=torch.float32, device=x.device) for name, v in scales.items()}

    def gather(self, spans: list, device: Any) -> tuple[Any, Any]:
        """The row index of ``spans`` and their scales (a float when all equal, else one per row), memoised
        for the current call (every layer asks for the same spans)."""
        key = (id(spans), device)
        hit = self._gathered.get(key)
        if hit is None or hit[0] is not spans:
            import torch

            index = torch.cat([torch.arange(a, b) for a, b, _ in spans]).to(device)
            values = {s for _, _, s in spans}
            scales: Any = (values.pop() if len(values) == 1 else
                           torch.tensor([s for a, b, s in spans for _ in range(b - a)], device=device))
            if len(self._gathered) > 64:
                self._gathered.clear()
            hit = self._gathered[key] = (spans, index, scales)
        return hit[1], hit[2]

    def _build_plan(self, call: Any, batch: int) -> list:
        if not self.active:
            return []
        if call is None or not call.covers(batch):
            raise RuntimeError(f"a LoRA layer ran on {batch} rows outside a denoiser call whose rows are known "
                               f"(use_denoise_call): the rows' adapters cannot be told apart")
        rows: dict[str, list[tuple[int, int, float]]] = {}
        for group, start, stop in call.spans():
            state = group.state
            entry = self.active.get(getattr(state, "request_id", None)) if state is not None else None
            if entry is None:
                if state is not None and state.request.sampling_params.lora is not None:
                    raise RuntimeError(f"request {state.request_id!r} asks for LoRA {state.request.sampling_params.lora!r}"
                                       f" but it was not acquired in this worker")
                continue
            name, scale = entry
            if scale == 0.0:
                continue
            spans = rows.setdefault(name, [])
            if spans and spans[-1][1] == start and spans[-1][2] == scale:
                spans[-1] = (spans[-1][0], stop, scale)
            else:
                spans.append((start, stop, scale))
        return list(rows.items())


class PerRowLora(ModuleHook):
    """The ``new_forward`` of one peft LoRA layer (see the module docstring): peft's own per-adapter
    ``lora_A``/``lora_B``/``scaling`` (``base(x) + B(A(x)) * scaling * scale``), with the rows and each row's
    scale from :meth:`LoraManager.plan`. For Linear layers each span of rows is one ``A`` matmul and one
    in-place ``addmm_`` into the base output (the scale as its ``alpha``): three kernels per span instead of
    peft's five, which is what keeps the unmerged overhead small on narrow models. Which rows use which
    adapter comes from the current DenoiseCall through the manager, never from the layer."""

    order = STAGES["lora"]

    def __init__(self, manager: LoraManager) -> None:
        super().__init__()
        self.manager = manager

    def new_forward(self, layer: Any, x: Any, *args: Any, **kwargs: Any) -> Any:
        import torch

        manager = self.manager
        if torch.compiler.is_compiling():
            return self._compiled_forward(layer, x, *args, **kwargs)
        result = layer.base_layer(x, *args, **kwargs)
        plan = manager.plan(x.shape[0])
        if not plan:
            return result
        for name, spans in plan:
            if name not in layer.lora_A:  # this adapter does not target this layer
                continue
            a, b = layer.lora_A[name], layer.lora_B[name]
            base_scale = layer.scaling[name]
            fast = (isinstance(a, torch.nn.Linear) and isinstance(b, torch.nn.Linear) and b.bias is None
                    and a.weight.dtype == x.dtype == result.dtype and result.is_contiguous() and not layer.training)
            if fast and len(spans) > 2:  # many spans (adapters interleaved): gather the rows once
                index, scales = manager.gather(spans, x.device)
                h = torch.nn.functional.linear(x.index_select(0, index), a.weight, a.bias)
                delta = torch.nn.functional.linear(h, b.weight)
                if isinstance(scales, float):
                    result.index_add_(0, index, delta, alpha=base_scale * scales)
                else:
                    result.index_add_(0, index, delta * (scales * base_scale).view(-1, *([1] * (delta.dim() - 1))))
                continue
            for start, stop, scale in spans:
                rows = x if (start == 0 and stop == x.shape[0]) else x[start:stop]
                out = result if rows is x else result[start:stop]
                if fast:
                    h = torch.nn.functional.linear(rows, a.weight, a.bias)
                    out.view(-1, out.shape[-1]).addmm_(h.reshape(-1, h.shape[-1]), b.weight.t(),
                                                      alpha=base_scale * scale)
                else:
                    delta = b(a(layer.lora_dropout[name](rows.to(a.weight.dtype))))
                    out += (delta * (base_scale * scale)).to(result.dtype)
        return result


    def _compiled_forward(self, layer: Any, x: Any, *args: Any, **kwargs: Any) -> Any:
        """The same deltas under torch.compile: every loaded adapter on all rows times its per-row scale tensor
        (0 on rows without it, which adds exact zeros), from :meth:`LoraManager.prepare_compiled`. The eager
        path's spans are Python ints: traced, each new row layout would be a guard failure and a recompile."""
        result = layer.base_layer(x, *args, **kwargs)
        for name, scales in self.manager.compiled_rows.items():
            if name not in layer.lora_A:
                continue
            a, b = layer.lora_A[name], layer.lora_B[name]
            delta = b(a(layer.lora_dropout[name](x.to(a.weight.dtype))))
            row = (scales * layer.scaling[name]).view(-1, *([1] * (delta.dim() - 1)))
            result = result + (delta * row).to(result.dtype)
        return result

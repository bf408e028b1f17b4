"""``cache_dit``: the cache-dit library's DBCache on Omni's pipelines, with a cache context per request.

cache-dit keeps its state in a *cache context* looked up by name while the transformer runs, and decides
for the whole batch of a call. Omni batches requests (and, in STEP_BATCH mode, requests at different steps),
so this backend gives every (request, CFG branch, expert) a ``CachedContext`` of its own, stored in the
request's ``StepState.cache_state`` and sized to the request's step count (``num_inference_steps``, and its
own SCM mask). A transformer call that holds several requests is split per request: each request's rows
run through cache-dit's forward with its own context in place. The trade-off: a batched call becomes one
call per request (cache-dit decides per call, so per-request decisions need per-request calls); requests
alone in their call (batch size 1) pay nothing extra.

With ``residual_diff_threshold`` 0 (and no SCM mask) the backend calls the transformer's original forward,
so the output is bit-identical to running without a cache.
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
from typing import Any

import attrs

from omni_core.cache import CacheBackend
from omni_core.errors import ConfigError
from omni_core.forward_context import forward_context, use_forward_context

from omni_cache_dit.config import CacheDiTConfig

logger = logging.getLogger("omni_cache_dit")


@attrs.frozen
class ModelSpec:
    """What the backend needs to know about a denoiser class."""

    blocks_attr: str
    #: forward arguments whose first dimension is the batch (sliced per request)
    batch_args: tuple[str, ...]
    #: for a model cache-dit does not know: the ForwardPattern of its blocks and a forward that runs the model
    #: with its block loop replaced by a module (``forward(model, block_stack, *args, **kwargs)``); None = cache
    #: the model itself through cache-dit's own registered adapter
    pattern: str | None = None
    stacked_forward: Any = None


class BlockStack:
    """Factory of the module that runs a model's block loop (``hidden = block(hidden, *args)`` for each
    block), which cache-dit caches in place of the model (the model itself keeps its blocks untouched)."""

    def __new__(cls, blocks: Any) -> Any:
        from torch import nn

        class _BlockStack(nn.Module):
            def __init__(self, blocks: nn.ModuleList) -> None:
                super().__init__()
                self.blocks = blocks

            def forward(self, hidden: Any, *args: Any) -> Any:
                for block in self.blocks:
                    hidden = block(hidden, *args)
                return hidden

        return _BlockStack(blocks)


def _shapes_forward(model: Any, stack: Any, hidden_states: Any, timestep: Any, encoder_hidden_states: Any,
                    encoder_mask: Any = None) -> Any:
    """``ShapesTransformer2DModel.forward`` as its docstring states it (embed -> blocks -> unembed)."""
    h, w = hidden_states.shape[-2:]
    tokens, temb, context = model.embed(hidden_states, timestep, encoder_hidden_states, encoder_mask)
    tokens = stack(tokens, temb, context, encoder_mask)
    return model.unembed(tokens, temb, h, w)


MODELS = {
    "QwenImageTransformer2DModel": ModelSpec(
        "transformer_blocks", ("hidden_states", "encoder_hidden_states", "encoder_hidden_states_mask", "timestep",
                               "img_shapes", "guidance", "additional_t_cond")),
    "WanTransformer3DModel": ModelSpec(
        "blocks", ("hidden_states", "timestep", "encoder_hidden_states", "encoder_hidden_states_image")),
    # Omni's demo DiT: blocks take (hidden, temb, context, context_mask) and return hidden
    "ShapesTransformer2DModel": ModelSpec(
        "blocks", ("hidden_states", "timestep", "encoder_hidden_states", "encoder_mask"), pattern="Pattern_3",
        stacked_forward=_shapes_forward),
}
#: forward-context extras that hold one row per batch row
CONTEXT_BATCH_KEYS = ("text_mask",)


@attrs.define(eq=False)
class _Denoiser:
    name: str
    module: Any
    spec: ModelSpec
    manager: Any
    context_name: str
    init_kwargs: dict
    #: runs the model with cache-dit (with whichever context is in place)
    cached_forward: Any
    #: the model's own forward (threshold 0: no cache-dit at all)
    plain_forward: Any
    signature: Any
    #: what cache-dit was enabled on (the model, or its BlockStack)
    target: Any


@attrs.define(eq=False)
class DiTState:
    """One request's cache-dit context for one (CFG branch, expert)."""

    context: Any
    calls: int = 0


def denoisers(pipeline: Any) -> dict[str, Any]:
    """name -> transformer: a pipeline's ``experts`` (Wan 2.2), else its ``transformer`` / ``transformer_2``."""
    from torch import nn

    experts = getattr(pipeline, "experts", None)
    if isinstance(experts, dict) and experts:
        return dict(experts)
    out = {}
    for owner in (pipeline, getattr(pipeline, "pipe", None)):
        for name in ("transformer", "transformer_2"):
            module = getattr(owner, name, None) if owner is not None else None
            if isinstance(module, nn.Module) and name not in out:
                out[name] = module
    return out


class CacheDiTBackend(CacheBackend):
    name = "cache_dit"
    requires = ("cache_dit",)

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        super().__init__(config)
        self.options = CacheDiTConfig.from_dict(config)
        self.denoisers: dict[str, _Denoiser] = {}
        self._fallback: dict[tuple, DiTState] = {}
        #: transformer calls split into one call per request
        self.split_calls = 0

    # ------------------------------------------------------------------ lifecycle
    def enable(self, pipeline: Any) -> None:
        import cache_dit
        from cache_dit import BlockAdapter, DBCacheConfig, ForwardPattern, TaylorSeerCalibratorConfig

        from omni_core.distributed import get_sp_group

        if get_sp_group().world_size > 1:
            raise ConfigError("cache_dit cannot run with Omni's sequence parallelism: its skip decisions are not "
                              "agreed across ranks (use tea_cache, whose decisions are)", field="cache_backend")
        found = denoisers(pipeline)
        if not found:
            raise ConfigError(f"cache_dit: {type(pipeline).__name__} exposes no transformer to cache",
                              field="cache_backend")
        opts = self.options
        for name, module in found.items():
            cls = type(module).__name__
            spec = MODELS.get(cls)
            if spec is None:
                raise ConfigError(f"cache_dit: {cls} is not supported by this backend; supported denoisers: "
                                  f"{', '.join(MODELS)}", field="cache_backend")
            n_blocks = len(getattr(module, spec.blocks_attr))
            if opts.Fn_compute_blocks >= n_blocks or opts.Fn_compute_blocks + opts.Bn_compute_blocks > n_blocks:
                raise ConfigError(f"cache_config.Fn_compute_blocks={opts.Fn_compute_blocks} and Bn_compute_blocks="
                                  f"{opts.Bn_compute_blocks} do not fit {cls} ({name}) with {n_blocks} blocks: Fn must "
                                  f"be < {n_blocks} and Fn + Bn <= {n_blocks}", field="cache_config.Fn_compute_blocks")
            cache_config = DBCacheConfig(
                Fn_compute_blocks=opts.Fn_compute_blocks, Bn_compute_blocks=opts.Bn_compute_blocks,
                residual_diff_threshold=opts.residual_diff_threshold, max_warmup_steps=opts.max_warmup_steps,
                warmup_interval=opts.warmup_interval, max_cached_steps=opts.max_cached_steps,
                max_continuous_cached_steps=opts.max_continuous_cached_steps,
                # one context per CFG branch: every context sees one call per step
                enable_separate_cfg=False, steps_computation_policy=opts.scm_steps_policy)
            calibrator = (TaylorSeerCalibratorConfig(taylorseer_order=opts.taylorseer_order)
                          if opts.enable_taylorseer else None)
            original = module.forward
            if spec.pattern is None:
                target = module
                cache_dit.enable_cache(module, cache_config=cache_config, calibrator_config=calibrator)
                cached_forward, plain_forward = module.forward, module._original_forward
            else:
                target = BlockStack(getattr(module, spec.blocks_attr))
                cache_dit.enable_cache(BlockAdapter(transformer=target, blocks=target.blocks,
                                                    forward_pattern=getattr(ForwardPattern, spec.pattern),
                                                    check_forward_pattern=False),
                                       cache_config=cache_config, calibrator_config=calibrator)
                cached_forward = functools.partial(spec.stacked_forward, module, target)
                plain_forward = original
            manager = target._context_manager
            (context_name,) = target._context_names
            if not isinstance(getattr(manager, "_cached_context_manager", None), dict):
                cache_dit.disable_cache(target)
                raise ConfigError("cache_dit: this cache-dit version keeps its contexts differently; per-request "
                                  "contexts need cache-dit 1.5 (CachedContextManager._cached_context_manager)",
                                  field="cache_backend")
            den = _Denoiser(name=name, module=module, spec=spec, manager=manager, context_name=context_name,
                            init_kwargs=copy.deepcopy(manager.get_context(context_name)._init_kwargs),
                            cached_forward=cached_forward, plain_forward=plain_forward,
                            signature=inspect.signature(original), target=target)
            module.forward = self._forward(den)
            self.denoisers[name] = den
        self.enabled = True

    def disable(self, pipeline: Any = None) -> None:
        import cache_dit

        for den in self.denoisers.values():
            den.module.__dict__.pop("forward", None)
            if den.target is den.module:
                den.module.forward = den.cached_forward  # cache-dit restores the model from its own wrapper
            cache_dit.disable_cache(den.target)
            den.module.__dict__.pop("forward", None)
        self.denoisers.clear()
        self.enabled = False

    def begin_request(self, state: Any) -> None:
        state.cache_state.clear()
        self._fallback.clear()

    def request_metrics(self, state: Any) -> dict[str, Any]:
        dits = {k: v for k, v in state.cache_state.items() if isinstance(v, DiTState)}
        if not dits:
            dits = {k[1]: v for k, v in self._fallback.items()}
        branches = {}
        computed = reused = 0
        for key, dit in dits.items():
            # what cache_dit.summary reports for a context: its cached steps and residual diffs
            cached = list(dit.context.get_cached_steps()) if dit.context is not None else []
            diffs = dit.context.get_residual_diffs() if dit.context is not None else {}
            computed += dit.calls - len(cached)
            reused += len(cached)
            branches["/".join(str(p) for p in key)] = {
                "computed": dit.calls - len(cached), "reused": len(cached), "cached_steps": cached,
                "residual_diffs": {k: round(float(v), 6) for k, v in diffs.items()}}
        return {"cache_backend": self.name, "steps_computed": computed, "steps_reused": reused,
                "cache_branches": branches}

    # ------------------------------------------------------------------ per-request contexts
    def _new_context(self, den: _Denoiser, num_steps: int | None) -> Any:
        import cache_dit

        kwargs = copy.deepcopy(den.init_kwargs)
        cfg = kwargs["cache_config"]
        cfg.num_inference_steps = num_steps
        if self.options.scm_steps_mask_policy is not None and num_steps:
            cfg.steps_computation_mask = cache_dit.steps_mask(total_steps=num_steps,
                                                              mask_policy=self.options.scm_steps_mask_policy)
        kwargs["name"] = den.context_name
        return den.manager.new_context(**kwargs)

    def _dit_state(self, den: _Denoiser, state: Any, key: tuple) -> DiTState:
        """The (request, branch, expert)'s context (the backend's own for a call without extras); none is made
        while the threshold is 0 (the original forward runs, calls are only counted)."""
        store, skey = (self._fallback, (den.name, key)) if state is None else (state.cache_state, key)
        dit = store.get(skey)
        if not isinstance(dit, DiTState):
            context = None
            if not self.options.never_reuses:
                context = self._new_context(den, state.num_steps if state is not None else None)
            dit = store[skey] = DiTState(context)
        return dit

    def _forward(self, den: _Denoiser) -> Any:
        def forward(*args: Any, **kwargs: Any) -> Any:
            a = den.signature.bind(*args, **kwargs).arguments
            batch = a["hidden_states"].shape[0]
            ex = forward_context().extras
            states, rows = ex.get("states"), ex.get("rows")
            branch, expert = ex.get("branch"), ex.get("expert")
            if states and rows and len(states) == len(rows) and sum(rows) == batch:
                n = len(states)
                branches = list(branch) if isinstance(branch, (list, tuple)) else [branch] * n
                experts = list(expert) if isinstance(expert, (list, tuple)) else [expert] * n
            else:  # no per-request extras: the whole call is one request
                states, rows = [None], [batch]
                branches = [branch if isinstance(branch, str) else None]
                experts = [expert if isinstance(expert, str) else None]
            keys = [(br or "cond", exp or den.name) for br, exp in zip(branches, experts)]
            dits = [self._dit_state(den, s, k) for s, k in zip(states, keys)]
            if self.options.never_reuses:
                for dit in dits:
                    dit.calls += 1
                return den.plain_forward(*args, **kwargs)
            if len(dits) == 1:
                return self._run(den, dits[0], args, kwargs)
            self.split_calls += 1
            outs, start = [], 0
            for state, r, dit, br, exp in zip(states, rows, dits, branches, experts):
                part = {name: _rows(value, start, start + r, batch, name) if name in den.spec.batch_args else value
                        for name, value in a.items()}
                extras = {**ex, "states": [state], "rows": [r], "branch": br, "expert": exp}
                for k in CONTEXT_BATCH_KEYS:
                    if k in extras:
                        extras[k] = _rows(extras[k], start, start + r, batch, k)
                with use_forward_context(extras=extras):
                    outs.append(self._run(den, dit, (), part))
                start += r
            return _concat(outs)

        return forward

    def _run(self, den: _Denoiser, dit: DiTState, args: tuple, kwargs: dict) -> Any:
        """One cache-dit forward with ``dit``'s context in place of the transformer's."""
        den.manager._cached_context_manager[den.context_name] = dit.context
        dit.calls += 1
        return den.cached_forward(*args, **kwargs)


def _rows(value: Any, lo: int, hi: int, batch: int, name: str) -> Any:
    import torch

    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.dim() == 0 or value.shape[0] == 1:
            return value
        if value.shape[0] == batch:
            return value[lo:hi]
    elif isinstance(value, (list, tuple)) and len(value) == batch:
        return value[lo:hi]
    raise ValueError(f"cache_dit: cannot split argument {name!r} (batch {batch}) per request: "
                     f"{type(value).__name__} of shape/length "
                     f"{tuple(value.shape) if hasattr(value, 'shape') else len(value)}")


def _concat(outs: list) -> Any:
    import torch

    first = outs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(outs)
    if isinstance(first, (tuple, list)):
        return type(first)(torch.cat(parts) if isinstance(parts[0], torch.Tensor) else parts[0]
                           for parts in zip(*outs))
    if hasattr(first, "sample"):
        first.sample = torch.cat([o.sample for o in outs])
        return first
    raise TypeError(f"cache_dit: cannot join transformer outputs of type {type(first).__name__}")

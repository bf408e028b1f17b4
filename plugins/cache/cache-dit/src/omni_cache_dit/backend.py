"""``cache_dit``: the cache-dit library's DBCache on any Omni pipeline, with a cache context per request.

The backend reads only the pipeline's declared :class:`~omni_core.pipelines.denoiser.DenoiserSpec` s: their
blocks and block call become a module cache-dit is enabled on through its own ``BlockAdapter``
(:mod:`omni_cache_dit.blocks`), so a model works by declaration, with no table of model classes here.

cache-dit keeps its state in a *cache context* looked up by name while the blocks run, and decides for the
whole batch of a call. Omni batches requests (and, in STEP_BATCH mode, requests at different steps), so this
backend gives every (request, CFG branch, denoiser) a ``CachedContext`` of its own, stored in the request's
``StepState.hook_state`` (``omni_core.hooks.state_store``) and sized to the request's step count (``num_inference_steps``, and its own SCM
mask). A denoiser call whose typed context (``forward_context().call``) holds several row groups is split
per group: each group's rows (the spec's ``batch_args``, sliced with :mod:`omni_core.cache.rows`) run through
the cached forward with its own context in place, under a call context of that group alone. The trade-off:
a batched call becomes one call per group (cache-dit decides per call, so per-request decisions need
per-request calls); a call of one group pays nothing extra. Because every group runs apart, a spec's
``rows_separable`` does not matter here.

A context's rows are all on this rank (CFG parallelism puts whole branches on ranks; sequence parallelism is
refused), so its decisions use this rank's residuals only: cache-dit's own averaging of the residual diff over
every rank of ``torch.distributed`` is turned off (:func:`_decide_on_this_rank`).

With ``residual_diff_threshold`` 0 (and no SCM mask) the backend calls the denoiser's original forward, so
the output is bit-identical to running without a cache.
"""

from __future__ import annotations

import copy
import inspect
import logging
from typing import Any

import attrs

from omni_core.cache import CacheBackend
from omni_core.cache.rows import concat_rows, slice_rows
from omni_core.errors import ConfigError
from omni_core.forward_context import forward_context, use_forward_context
from omni_core.hooks import FunctionHook, add_hook, remove_hook, standalone_state, state_store
from omni_core.pipelines.denoiser import denoisers_of, model_folder_of

from omni_cache_dit.blocks import (build_stack, build_stand_ins, forward_pattern, install_stand_ins, remove_stand_ins,
                                   stand_ins_active)
from omni_cache_dit.config import CacheDiTConfig, cache_dit_config

logger = logging.getLogger("omni_cache_dit")

#: the registry name of this backend's hook on each denoiser
HOOK = "cache_dit"


@attrs.define(eq=False)
class _Denoiser:
    spec: Any
    #: the user's cache_config over the model's shipped ``cache_defaults["cache_dit"]``
    options: CacheDiTConfig
    manager: Any
    context_name: str
    init_kwargs: dict
    #: what cache-dit was enabled on (the spec's block stack)
    stack: Any
    #: the blocks' forwards during a cached forward (block 0 runs the stack, the others pass through), as
    #: ``STAND_IN`` hooks on the blocks that are active only inside :meth:`cached_forward`
    stand_ins: Any
    signature: Any

    @property
    def name(self) -> str:
        return self.spec.name

    def cached_forward(self, below: Any, *args: Any, **kwargs: Any) -> Any:
        """``below`` (the hook chain under this backend's hook, ending in the module's own forward) with the
        blocks' stand-ins active: block 0 runs the cached stack."""
        with stand_ins_active(self.spec):
            return below(*args, **kwargs)


@attrs.define(eq=False)
class DiTState:
    """One request's cache-dit context for one (CFG branch, denoiser)."""

    context: Any
    calls: int = 0


class CacheDiTBackend(CacheBackend):
    name = "cache_dit"

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        super().__init__(config)
        self.options = cache_dit_config(config)
        self.denoisers: dict[str, _Denoiser] = {}
        #: denoiser calls split into one call per row group
        self.split_calls = 0
        #: the diffusers pipeline cached whole (``_enable_whole``), or None
        self.whole: Any = None

    # ------------------------------------------------------------------ lifecycle
    def enable(self, pipeline: Any) -> None:
        from omni_core.distributed import get_sp_group

        if get_sp_group().world_size > 1:
            raise ConfigError("cache_dit cannot run with Omni's sequence parallelism: its skip decisions are not "
                              "agreed across ranks (use tea_cache, whose decisions are)", field="cache_backend")
        whole = getattr(pipeline, "diffusers_call_pipeline", None)
        if whole is not None:
            self._enable_whole(whole)
            return
        specs = denoisers_of(pipeline)
        folder = model_folder_of(pipeline)
        made: list[_Denoiser] = []
        try:
            for spec in specs:
                den = self._prepare(spec, spec.defaults_for(self.name, folder))
                made.append(den)
                install_stand_ins(spec, den.stand_ins)
                add_hook(spec.module, HOOK, FunctionHook(self._forward(den)))
        except Exception:
            self._release(made)  # a model that cannot be cached is left exactly as loaded
            raise
        self.denoisers = {den.name: den for den in made}
        self.enabled = True

    def _prepare(self, spec: Any, defaults: dict) -> _Denoiser:
        """Enable cache-dit on ``spec``'s block stack with the user's config over the model's ``defaults``."""
        import cache_dit
        from cache_dit import BlockAdapter, DBCacheConfig, TaylorSeerCalibratorConfig

        spec.check_block_signature("cache_dit")
        opts = cache_dit_config({**defaults, **self.config})
        n_blocks = len(spec.blocks)
        if opts.Fn_compute_blocks >= n_blocks or opts.Fn_compute_blocks + opts.Bn_compute_blocks > n_blocks:
            raise ConfigError(f"cache_config.Fn_compute_blocks={opts.Fn_compute_blocks} and Bn_compute_blocks="
                              f"{opts.Bn_compute_blocks} do not fit the {spec.name!r} denoiser "
                              f"({type(spec.module).__name__}) with {n_blocks} blocks: Fn must be < {n_blocks} and "
                              f"Fn + Bn <= {n_blocks}", field="cache_config.Fn_compute_blocks")
        pattern = forward_pattern(spec)
        cache_config = DBCacheConfig(
            Fn_compute_blocks=opts.Fn_compute_blocks, Bn_compute_blocks=opts.Bn_compute_blocks,
            residual_diff_threshold=opts.residual_diff_threshold, max_warmup_steps=opts.max_warmup_steps,
            warmup_interval=opts.warmup_interval, max_cached_steps=opts.max_cached_steps,
            max_continuous_cached_steps=opts.max_continuous_cached_steps,
            # one context per CFG branch: every context sees one call per step
            enable_separate_cfg=False, steps_computation_policy=opts.scm_steps_policy)
        calibrator = (TaylorSeerCalibratorConfig(taylorseer_order=opts.taylorseer_order)
                      if opts.enable_taylorseer else None)
        stack = build_stack(spec)
        cache_dit.enable_cache(BlockAdapter(transformer=stack, blocks=stack.blocks, forward_pattern=pattern),
                               cache_config=cache_config, calibrator_config=calibrator)
        manager = stack._context_manager
        (context_name,) = stack._context_names
        if not isinstance(getattr(manager, "_cached_context_manager", None), dict):
            cache_dit.disable_cache(stack)
            raise ConfigError("cache_dit: this cache-dit version keeps its contexts differently; per-request "
                              "contexts need cache-dit 1.5 (CachedContextManager._cached_context_manager)",
                              field="cache_backend")
        _decide_on_this_rank(manager, stack)
        return _Denoiser(spec=spec, options=opts, manager=manager, context_name=context_name,
                         init_kwargs=copy.deepcopy(manager.get_context(context_name)._init_kwargs), stack=stack,
                         stand_ins=build_stand_ins(spec, stack), signature=inspect.signature(spec.module.forward))

    def _enable_whole(self, pipe: Any) -> None:
        """cache-dit's own adapter for a whole diffusers pipeline (the diffusers backend runs its call): cache-dit
        finds the block stack for the pipeline's family and refreshes its context at each call, so the requests of
        one call share one context (their rows decide together)."""
        import cache_dit
        from cache_dit import DBCacheConfig, TaylorSeerCalibratorConfig

        opts = self.options
        config = DBCacheConfig(
            Fn_compute_blocks=opts.Fn_compute_blocks, Bn_compute_blocks=opts.Bn_compute_blocks,
            residual_diff_threshold=opts.residual_diff_threshold, max_warmup_steps=opts.max_warmup_steps,
            warmup_interval=opts.warmup_interval, max_cached_steps=opts.max_cached_steps,
            max_continuous_cached_steps=opts.max_continuous_cached_steps,
            steps_computation_policy=opts.scm_steps_policy)
        calibrator = (TaylorSeerCalibratorConfig(taylorseer_order=opts.taylorseer_order)
                      if opts.enable_taylorseer else None)
        try:
            cache_dit.enable_cache(pipe, cache_config=config, calibrator_config=calibrator)
        except Exception as exc:  # noqa: BLE001 - a family cache-dit has no adapter for
            raise ConfigError(f"cache_dit cannot cache {type(pipe).__name__}: {type(exc).__name__}: {exc}",
                              field="cache_backend") from exc
        self.whole = pipe
        self.enabled = True

    def _release(self, dens: Any) -> None:
        import cache_dit

        for den in dens:
            remove_hook(den.spec.module, HOOK, missing_ok=True)
            remove_stand_ins(den.spec)
            cache_dit.disable_cache(den.stack)

    def disable(self, pipeline: Any = None) -> None:
        if self.whole is not None:
            import cache_dit

            cache_dit.disable_cache(self.whole)
            self.whole = None
        self._release(self.denoisers.values())
        self.denoisers.clear()
        self.enabled = False

    def request_metrics(self, state: Any) -> dict[str, Any]:
        if self.whole is not None:  # the last call's steps (a request's call is the last of its wave's calls)
            import cache_dit

            stats = [s for s in cache_dit.summary(self.whole, details=False) or []
                     if getattr(s, "cached_steps", None) is not None][:1]
            cached = list(stats[0].cached_steps) if stats else []
            return {"cache_backend": self.name, "steps_reused": len(cached),
                    "steps_computed": max(0, state.num_steps - len(cached)), "cached_steps": cached}
        dits = ({k: v for k, v in state.cache_state.items() if isinstance(v, DiTState)}
                or {k: v for k, v in standalone_state().items() if isinstance(v, DiTState)})
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
        if den.options.scm_steps_mask_policy is not None and num_steps:
            cfg.steps_computation_mask = cache_dit.steps_mask(total_steps=num_steps,
                                                              mask_policy=den.options.scm_steps_mask_policy)
        kwargs["name"] = den.context_name
        return den.manager.new_context(**kwargs)

    def _dit_state(self, den: _Denoiser, state: Any, branch: str) -> DiTState:
        """The (request, branch, denoiser)'s context (the backend's own for a call without a typed context);
        none is made while the threshold is 0 (the original forward runs, calls are only counted)."""
        def make() -> DiTState:
            reuses = not den.options.never_reuses
            return DiTState(self._new_context(den, state.num_steps if state is not None else None) if reuses else None)

        store, key = state_store(state), (branch, den.name)  # the request's own; no request: the core's standalone
        dit = store.get(key)
        if not isinstance(dit, DiTState):
            dit = store[key] = make()
        return dit

    def _forward(self, den: _Denoiser) -> Any:
        batch_args = set(den.spec.batch_args)

        def forward(below: Any, *args: Any, **kwargs: Any) -> Any:
            a = den.signature.bind(*args, **kwargs).arguments
            batch = _batch_of(a, den)
            call = forward_context().call
            if call is not None and call.covers(batch):
                spans = call.spans()
            else:  # no typed context for these rows: the whole call is one request
                call, spans = None, [(None, 0, batch)]
            dits = [self._dit_state(den, g.state if g is not None else None, g.branch if g is not None else "cond")
                    for g, _, _ in spans]
            if den.options.never_reuses:
                for dit in dits:
                    dit.calls += 1
                return below(*args, **kwargs)
            if len(dits) == 1:
                return self._run(den, dits[0], below, args, kwargs)
            self.split_calls += 1
            outs = []
            for i, ((_, lo, hi), dit) in enumerate(zip(spans, dits)):
                part = {name: slice_rows(value, lo, hi, batch, name) if name in batch_args else value
                        for name, value in a.items()}
                with use_forward_context(call=call.select([i])):
                    outs.append(self._run(den, dit, below, (), part))
            return concat_rows(outs)

        return forward

    def _run(self, den: _Denoiser, dit: DiTState, below: Any, args: tuple, kwargs: dict) -> Any:
        """One cache-dit forward with ``dit``'s context in place of the stack's."""
        den.manager._cached_context_manager[den.context_name] = dit.context
        dit.calls += 1
        return den.cached_forward(below, *args, **kwargs)


def _decide_on_this_rank(manager: Any, stack: Any) -> None:
    """Make cache-dit decide from this rank's rows alone.

    cache-dit's cached blocks call ``manager.similarity(..., parallelized=True)`` whenever ``torch.distributed``
    is initialized with more than one rank, and then average the residual diff over the default process group
    (``dist.all_reduce(..., AVG)``): right when the ranks hold shards of one sequence (its context
    parallelism), wrong in Omni, where every context is one (request, CFG branch, denoiser) and its rows are
    all on this rank. Under ``cfg_parallel_size`` 2, rank 0 runs the cond branch and rank 1 the uncond one, so
    each branch decided on the mean of both branches' diffs (a different image from one process), and, as a
    collective only reached when a context's warmup and cached-step limits allow, it could pair with another
    rank's CFG all-gather or wait forever. (Omni's sequence parallelism, the only case where ranks share a
    sequence, is refused in :meth:`CacheDiTBackend.enable`.) The manager is this stack's own, made by
    ``enable_cache``; an instance attribute shadows the method for it alone."""
    similarity = manager.similarity
    try:
        params = inspect.signature(similarity).parameters
    except (TypeError, ValueError):
        params = {}
    if "parallelized" not in params:
        import cache_dit

        cache_dit.disable_cache(stack)
        raise ConfigError("cache_dit: this cache-dit version's CachedContextManager.similarity takes no "
                          "'parallelized' argument, so its skip decisions could not be kept to one rank; "
                          "per-request contexts need cache-dit 1.5", field="cache_backend")

    def similarity_on_this_rank(t1: Any, t2: Any, *args: Any, parallelized: bool = False, **kwargs: Any) -> Any:
        return similarity(t1, t2, *args, parallelized=False, **kwargs)

    manager.similarity = similarity_on_this_rank


def _batch_of(arguments: dict, den: _Denoiser) -> int:
    """The call's row count: the first dimension of its first tensor ``batch_arg``."""
    for name in den.spec.batch_args:
        value = arguments.get(name)
        if hasattr(value, "shape") and len(value.shape) > 0:
            return int(value.shape[0])
    raise ConfigError(f"cache_dit: the {den.name!r} denoiser's call has no tensor among its batch_args "
                      f"{list(den.spec.batch_args)}, so its rows cannot be told apart per request",
                      field="batch_args")

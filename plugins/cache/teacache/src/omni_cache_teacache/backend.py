"""``tea_cache``: TeaCache with a decision and a residual cache per request, CFG branch and expert.

TeaCache skips a denoiser's transformer blocks while block 0's timestep-modulated input has barely moved
since the last computed step, and adds the residual (blocks' output minus their input) cached at that step
instead. The reference keeps one such state per module, so a batch follows its first row's decision. Here
everything about the model comes from the pipeline's declared
:class:`~omni_core.pipelines.denoiser.DenoiserSpec` list (blocks, block parameters, carried streams, residual
stream, per-row side inputs, ``modulated_input``, ``rows_separable``, shipped defaults), and every call reads
from the typed :class:`~omni_core.forward_context.DenoiseCall` which rows belong to which request, branch and
expert, so each request decides for itself:

* block 0's wrapper computes every row's modulated input, each request's relative L1 change, rescales it
  with the model's polynomial and accumulates it in ``state.hook_state[(branch, expert)]`` (``omni_core.hooks.request_state``);
* the blocks then run only the rows that must compute (their per-row inputs sliced, the call context narrowed
  with ``DenoiseCall.select``), the others pass through, and the last block's wrapper adds each reusing
  request's own cached residual.

When every row computes, every block receives exactly the arguments it would without the cache, so a
threshold of 0 gives bit-identical output. A call without a DenoiseCall (a caller that sets none) is one
request whose state lives in the backend until the next request begins.
"""

from __future__ import annotations

import contextvars
import logging
from typing import Any

import attrs

from omni_core.cache import CacheBackend
from omni_core.cache.calls import call_key, call_spans, current_call, only_groups
from omni_core.cache.rows import span_index
from omni_core.errors import ConfigError
from omni_core.hooks import FunctionHook, add_hook, remove_hook, request_state, standalone_state
from omni_core.pipelines.denoiser import DenoiserSpec, denoisers_of, model_folder_of

from omni_cache_teacache.config import GENERIC_DEFAULTS, TeaCacheConfig, tea_cache_config

logger = logging.getLogger("omni_cache_teacache")

_CURRENT: contextvars.ContextVar[_Call | None] = contextvars.ContextVar("omni_tea_cache_call", default=None)

#: the registry name of this backend's hooks (on each denoiser and on each of its blocks)
HOOK = "tea_cache"


@attrs.define(eq=False)
class TeaState:
    """One request's TeaCache state for one (CFG branch, expert)."""

    prev_mod: Any = None
    residual: Any = None
    #: accumulated rescaled change since the last computed step
    acc: float = 0.0
    consecutive: int = 0
    computed: int = 0
    reused: int = 0
    #: one entry per call: True = computed
    pattern: list = attrs.field(factory=list)
    #: calibration only: (step, rel-L1 change of the modulated input, rel-L1 change of the output)
    records: list | None = None
    prev_out: Any = None
    pending_rel: float | None = None


@attrs.define(eq=False)
class _Segment:
    state: Any  # StepState, or None for a call without a DenoiseCall
    start: int
    stop: int
    key: tuple
    tea: TeaState
    compute: bool = True

    @property
    def step(self) -> tuple[int, int | None]:
        if self.state is None:
            return len(self.tea.pattern), None
        return self.state.step_index, self.state.num_steps


@attrs.define(eq=False)
class _Denoiser:
    spec: DenoiserSpec
    options: TeaCacheConfig
    #: the modules carrying this backend's hook (the denoiser, then its blocks)
    saved: list = attrs.field(factory=list)

    @property
    def name(self) -> str:
        return self.spec.name


@attrs.define(eq=False)
class _Call:
    den: _Denoiser
    #: the DenoiseCall covering this call's batch (None: one request)
    context: Any = None
    segments: list = attrs.field(factory=list)
    #: all | none | slice | mask
    mode: str = "all"
    index: Any = None
    #: indices of the computing segments (slice mode)
    keep: list = attrs.field(factory=list)
    in0: dict = attrs.field(factory=dict)
    #: side argument name -> (the full tensor it came from, its compute rows)
    sliced: dict = attrs.field(factory=dict)


def _poly(coefficients: tuple[float, ...], x: float) -> float:
    out = 0.0
    for c in coefficients:
        out = out * x + c
    return out


def resolve_options(spec: DenoiserSpec, user: TeaCacheConfig, model_path: str | None = None) -> TeaCacheConfig:
    """The settings one denoiser runs with: the user's ``cache_config`` over the model folder's shipped
    ``cache_defaults.json`` over the spec's ``cache_defaults["tea_cache"]`` over generic defaults (raw relative
    change, see ``config.GENERIC_DEFAULTS``)."""
    shipped = spec.defaults_for(TeaCacheBackend.name, model_path)
    try:
        model = tea_cache_config(shipped)
    except ConfigError as exc:
        raise ConfigError(f"the {spec.name!r} denoiser's shipped tea_cache defaults are invalid: {exc}",
                          field=exc.field) from None
    merged = attrs.asdict(GENERIC_DEFAULTS, recurse=False)
    for layer in (model, user):
        merged.update({k: v for k, v in attrs.asdict(layer, recurse=False).items() if v is not None})
    if not shipped.get("coefficients") and user.coefficients is None:
        logger.info("tea_cache: the %r denoiser ships no coefficients; using the raw relative change (fit some "
                    "with `omni cache calibrate`)", spec.name)
    merged["warmup_steps"] = max(1, merged["warmup_steps"])
    return TeaCacheConfig(**merged)


class TeaCacheBackend(CacheBackend):
    name = "tea_cache"

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        super().__init__(config)
        self.options = tea_cache_config(config)
        self.denoisers: dict[str, _Denoiser] = {}
        #: calibration: compute every step and record (input change, output change) pairs
        self.record = False
        #: how calls ran: all rows computed / none / only some rows (sliced) / all rows, reused ones overwritten
        self.mode_counts = {"all": 0, "none": 0, "slice": 0, "mask": 0}

    # ------------------------------------------------------------------ lifecycle
    def enable(self, pipeline: Any) -> None:
        if getattr(pipeline, "diffusers_call_pipeline", None) is not None:
            raise ConfigError(f"tea_cache: {type(pipeline).__name__} runs a diffusers pipeline's own call and "
                              f"declares no denoiser (DenoiserSpec) whose steps tea_cache could skip; use "
                              f"cache_backend='cache_dit' (cache-dit's own adapters)", field="cache_backend")
        specs = denoisers_of(pipeline)
        if self.denoisers:
            self.disable(pipeline)
        folder = model_folder_of(pipeline)
        dens = []
        for spec in specs:
            if spec.modulated_input is None:
                raise ConfigError(f"tea_cache: the {spec.name!r} denoiser of {type(pipeline).__name__} declares no "
                                  f"modulated_input (block 0's timestep-modulated input, TeaCache's signal) in its "
                                  f"DenoiserSpec", field="modulated_input")
            spec.check_block_signature("tea_cache")
            dens.append(_Denoiser(spec=spec, options=resolve_options(spec, self.options, folder)))
        for den in dens:
            self._install(den)
            self.denoisers[den.name] = den
        self.enabled = True

    def disable(self, pipeline: Any = None) -> None:
        for den in self.denoisers.values():
            for module in reversed(den.saved):
                remove_hook(module, HOOK, missing_ok=True)
            den.saved.clear()
        self.denoisers.clear()
        self.enabled = False

    def request_metrics(self, state: Any) -> dict[str, Any]:
        teas = ({k: v for k, v in state.cache_state.items() if isinstance(v, TeaState)}
                or {k: v for k, v in standalone_state().items() if isinstance(v, TeaState)})
        branches = {"/".join(str(p) for p in key): {"computed": t.computed, "reused": t.reused,
                                                    "pattern": "".join("C" if c else "R" for c in t.pattern)}
                    for key, t in teas.items()}
        return {"cache_backend": self.name,
                "steps_computed": sum(t.computed for t in teas.values()),
                "steps_reused": sum(t.reused for t in teas.values()),
                "cache_branches": branches}

    # ------------------------------------------------------------------ hooks
    def _install(self, den: _Denoiser) -> None:
        spec = den.spec
        module = spec.module

        def transformer_forward(original: Any, *args: Any, **kwargs: Any) -> Any:
            call = _Call(den)
            token = _CURRENT.set(call)
            try:
                out = original(*args, **kwargs)
            finally:
                _CURRENT.reset(token)
            if self.record and call.segments:
                self._record_outputs(call, out)
            return out

        add_hook(module, HOOK, FunctionHook(transformer_forward))
        den.saved.append(module)
        blocks = spec.blocks
        last = len(blocks) - 1
        for i, block in enumerate(blocks):
            add_hook(block, HOOK, FunctionHook(self._block_forward(den, i, i == last)))
            den.saved.append(block)

    def _block_forward(self, den: _Denoiser, i: int, last: bool) -> Any:
        spec = den.spec
        params = spec.block_params

        def forward(original: Any, *args: Any, **kwargs: Any) -> Any:
            call = _CURRENT.get()
            if call is None or call.den is not den:
                return original(*args, **kwargs)
            a = dict(zip(params, args))
            a.update(kwargs)
            if i == 0:
                self._plan(call, a)
            if call.mode == "none":
                out = _returned(spec, a)
            elif call.mode == "slice":
                if i == 0:
                    for name in spec.carried:
                        a[name] = a[name].index_select(0, call.index)
                for name in spec.side_inputs:
                    a[name] = self._sliced(call, name, a.get(name))
                with only_groups(call.context, call.keep):
                    out = original(**a)
            else:
                out = original(**a)
            return self._finish(call, out) if last else out

        return forward

    def _sliced(self, call: _Call, name: str, value: Any) -> Any:
        import torch

        if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] == 1:
            return value
        cached = call.sliced.get(name)
        if cached is not None and cached[0] is value:
            return cached[1]
        out = value.index_select(0, call.index)
        call.sliced[name] = (value, out)
        return out

    # ------------------------------------------------------------------ decisions
    def _segments(self, call: _Call, batch: int) -> list[_Segment]:
        den = call.den
        call.context = current_call(batch)
        segments = []
        for group, start, stop in call_spans(batch):
            key = call_key(group, den.name)
            # the request's own (rows with no request: one run, the core's standalone store)
            tea = request_state(group, key, lambda: TeaState(records=[] if self.record else None))
            segments.append(_Segment(group.state if group is not None else None, start, stop, key, tea))
        return segments

    def _plan(self, call: _Call, a: dict) -> None:
        den, spec = call.den, call.den.spec
        hidden = a[spec.residual_stream]
        batch = hidden.shape[0]
        segments = call.segments = self._segments(call, batch)
        call.in0 = {name: a[name] for name in spec.carried}
        opts = den.options
        thresh = 0.0 if self.record else opts.rel_l1_thresh
        rels: list[float | None] = [None] * len(segments)
        if thresh > 0 or self.record:
            rels = self._changes(spec.modulated_input(spec.module, spec.blocks[0], a), segments)
        for seg, rel in zip(segments, rels):
            tea = seg.tea
            step, total = seg.step
            if self.record:
                tea.pending_rel = rel
            res = tea.residual
            force = (thresh <= 0 or rel is None or res is None or step < opts.warmup_steps
                     or (total is not None and step >= total - 1)
                     or res.shape != (seg.stop - seg.start, *hidden.shape[1:])
                     or (opts.max_consecutive_reuse is not None and tea.consecutive >= opts.max_consecutive_reuse))
            if force:
                compute = True
            else:
                tea.acc += _poly(opts.coefficients, rel)
                compute = tea.acc >= thresh
            if compute:
                tea.acc, tea.consecutive = 0.0, 0
                tea.computed += 1
            else:
                tea.consecutive += 1
                tea.reused += 1
            tea.pattern.append(compute)
            seg.compute = compute
        flags = [seg.compute for seg in segments]
        if all(flags):
            call.mode = "all"
        elif not any(flags):
            call.mode = "none"
        elif self._can_slice(call, a, batch):
            call.mode = "slice"
            call.keep = [k for k, seg in enumerate(segments) if seg.compute]
            call.index = span_index([(s.start, s.stop) for s in segments if s.compute], hidden.device)
        else:
            call.mode = "mask"
        self.mode_counts[call.mode] += 1

    def _can_slice(self, call: _Call, a: dict, batch: int) -> bool:
        """Rows can run apart when the spec says so, the call's context covers the batch (so the blocks see
        the computing rows' masks) and every side input is per-row or broadcast."""
        import torch

        spec = call.den.spec
        if not spec.rows_separable or call.context is None:
            return False
        values = [a.get(n) for n in spec.side_inputs] + [call.context.text_mask]
        return all(not isinstance(v, torch.Tensor) or v.dim() == 0 or v.shape[0] in (batch, 1) for v in values)

    def _changes(self, mod: Any, segments: list[_Segment]) -> list[float | None]:
        """Each segment's relative L1 change of its modulated input since its previous call (None on its
        first call); one host sync for all of them, summed over the sequence-parallel group."""
        import torch

        sums, where = [], []
        for k, seg in enumerate(segments):
            cur = mod[seg.start:seg.stop].detach()
            prev = seg.tea.prev_mod
            if prev is not None and prev.shape == cur.shape:
                cur_f, prev_f = cur.float(), prev.float()
                sums.append(torch.stack([(cur_f - prev_f).abs().sum(), prev_f.abs().sum()]))
                where.append(k)
            seg.tea.prev_mod = cur.clone()
        out: list[float | None] = [None] * len(segments)
        if not sums:
            return out
        vals = torch.stack(sums)
        from omni_core.distributed import get_sp_group

        group = get_sp_group()
        if group.world_size > 1:
            vals = group.all_reduce(vals)
        for k, (num, den) in zip(where, vals.tolist()):
            out[k] = num / den if den > 0 else float("inf")
        return out

    def _finish(self, call: _Call, out: Any) -> Any:
        """Last block: cache the computing requests' residuals, give the reusing ones theirs."""
        import torch

        spec = call.den.spec
        hidden = spec.residual_stream
        multi = len(spec.block_outputs) > 1
        outs = dict(zip(spec.block_outputs, out)) if multi else {hidden: out}
        in0 = call.in0[hidden]
        h_out = outs[hidden]
        if call.mode == "all":
            for seg in call.segments:
                seg.tea.residual = h_out[seg.start:seg.stop] - in0[seg.start:seg.stop]
            return out
        # a stream the last block drops (returns None for: a last joint block that keeps only the image) stays None
        pieces: dict[str, list] = {name: [] for name, value in outs.items() if value is not None}
        pos = 0
        for seg in call.segments:
            n = seg.stop - seg.start
            if seg.compute:
                lo, hi = (pos, pos + n) if call.mode == "slice" else (seg.start, seg.stop)
                pos += n
                for name in pieces:
                    pieces[name].append(outs[name][lo:hi])
                seg.tea.residual = h_out[lo:hi] - in0[seg.start:seg.stop]
            else:
                for name in pieces:
                    if name == hidden:
                        pieces[name].append(in0[seg.start:seg.stop] + seg.tea.residual)
                    else:
                        pieces[name].append(call.in0[name][seg.start:seg.stop])
        full = {name: torch.cat(pieces[name]) if name in pieces else None for name in outs}
        return tuple(full[n] for n in spec.block_outputs) if multi else full[hidden]

    # ------------------------------------------------------------------ calibration
    def _record_outputs(self, call: _Call, out: Any) -> None:
        import torch

        sample = out
        if isinstance(out, (tuple, list)):
            sample = out[0]
        elif hasattr(out, "sample"):
            sample = out.sample
        if not isinstance(sample, torch.Tensor):
            return
        for seg in call.segments:
            tea = seg.tea
            cur = sample[seg.start:seg.stop].detach().float()
            if tea.prev_out is not None and tea.pending_rel is not None and tea.records is not None:
                prev = tea.prev_out
                rel_out = ((cur - prev).abs().mean() / prev.abs().mean().clamp_min(1e-12)).item()
                tea.records.append((seg.step[0], tea.pending_rel, rel_out))
            tea.prev_out = cur.clone()


def _returned(spec: DenoiserSpec, a: dict) -> Any:
    """What a block returns when it is skipped: its carried inputs unchanged, in the declared order."""
    return tuple(a[n] for n in spec.block_outputs) if len(spec.block_outputs) > 1 else a[spec.block_outputs[0]]

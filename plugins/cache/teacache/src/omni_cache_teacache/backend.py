"""``tea_cache``: TeaCache with a decision and a residual cache per request, CFG branch and expert.

TeaCache skips a denoiser's transformer blocks while block 0's timestep-modulated input has barely moved
since the last computed step, and adds the residual (blocks' output minus their input) cached at that step
instead. The reference keeps one such state per module, so a batch follows its first row's decision. Here
every call reads, from the forward context the pipeline sets (``states``, ``rows``, ``branch``,
``expert``), which rows belong to which request, and each request decides for itself:

* block 0's wrapper computes every row's modulated input, each request's relative L1 change, rescales it
  with the model's polynomial and accumulates it in ``state.cache_state[(branch, expert)]``;
* the blocks then run only the rows that must compute (their per-row inputs sliced), the others pass
  through, and the last block's wrapper adds each reusing request's own cached residual.

When every row computes, every block receives exactly the arguments it would without the cache, so a
threshold of 0 gives bit-identical output. A call without the extras (a pipeline that does not set them)
is treated as one request whose state lives in the backend until the next request begins.
"""

from __future__ import annotations

import contextvars
import logging
from typing import Any

import attrs

from omni_core.cache import CacheBackend
from omni_core.errors import ConfigError
from omni_core.forward_context import forward_context, use_forward_context

from omni_cache_teacache.adapters import ModelAdapter, adapter_for, check_signature
from omni_cache_teacache.config import TeaCacheConfig

logger = logging.getLogger("omni_cache_teacache")

_CURRENT: contextvars.ContextVar[_Call | None] = contextvars.ContextVar("omni_tea_cache_call", default=None)


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
    state: Any  # StepState, or None for a call without forward-context extras
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
    name: str
    module: Any
    adapter: ModelAdapter
    coefficients: tuple[float, ...]
    thresh: float
    warmup: int
    blocks: Any
    #: (module, value of ``forward`` in its __dict__ before we replaced it, or None)
    saved: list = attrs.field(factory=list)


@attrs.define(eq=False)
class _Call:
    den: _Denoiser
    extras: dict
    segments: list = attrs.field(factory=list)
    #: all | none | slice | mask
    mode: str = "all"
    index: Any = None
    in0: dict = attrs.field(factory=dict)
    #: side argument name -> (the full tensor it came from, its compute rows)
    sliced: dict = attrs.field(factory=dict)
    sliced_extras: dict | None = None


def _poly(coefficients: tuple[float, ...], x: float) -> float:
    out = 0.0
    for c in coefficients:
        out = out * x + c
    return out


def denoisers(pipeline: Any) -> dict[str, Any]:
    """name -> transformer: a pipeline's ``experts`` (Wan 2.2: transformer, transformer_2), else its
    ``transformer`` / ``transformer_2`` (on the pipeline or its wrapped diffusers ``pipe``)."""
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


class TeaCacheBackend(CacheBackend):
    name = "tea_cache"
    requires = ("torch", "numpy")

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        super().__init__(config)
        self.options = TeaCacheConfig.from_dict(config)
        self.denoisers: dict[str, _Denoiser] = {}
        #: calibration: compute every step and record (input change, output change) pairs
        self.record = False
        self._fallback: dict[tuple, TeaState] = {}
        #: how calls ran: all rows computed / none / only some rows (sliced) / all rows, reused ones overwritten
        self.mode_counts = {"all": 0, "none": 0, "slice": 0, "mask": 0}

    # ------------------------------------------------------------------ lifecycle
    def enable(self, pipeline: Any) -> None:
        found = denoisers(pipeline)
        if not found:
            raise ConfigError(f"tea_cache: {type(pipeline).__name__} exposes no transformer to cache",
                              field="cache_backend")
        if self.denoisers:
            self.disable(pipeline)
        opts = self.options
        for name, module in found.items():
            try:
                adapter = adapter_for(module)
                blocks = getattr(module, adapter.blocks_attr)
                check_signature(adapter, blocks[0])
            except ValueError as exc:
                raise ConfigError(str(exc), field="cache_backend") from None
            coeffs, thresh, warmup = adapter.defaults(module)
            den = _Denoiser(name=name, module=module, adapter=adapter,
                            coefficients=opts.coefficients if opts.coefficients is not None else tuple(coeffs),
                            thresh=opts.rel_l1_thresh if opts.rel_l1_thresh is not None else thresh,
                            warmup=max(1, opts.warmup_steps if opts.warmup_steps is not None else warmup),
                            blocks=blocks)
            self._install(den)
            self.denoisers[name] = den
        self.enabled = True

    def disable(self, pipeline: Any = None) -> None:
        for den in self.denoisers.values():
            for module, before in reversed(den.saved):
                if before is None:
                    module.__dict__.pop("forward", None)
                else:
                    module.forward = before
            den.saved.clear()
        self.denoisers.clear()
        self.enabled = False

    def begin_request(self, state: Any) -> None:
        state.cache_state.clear()
        self._fallback.clear()

    def request_metrics(self, state: Any) -> dict[str, Any]:
        teas = {k: v for k, v in state.cache_state.items() if isinstance(v, TeaState)}
        if not teas:
            teas = {k[1]: v for k, v in self._fallback.items()}
        branches = {"/".join(str(p) for p in key): {"computed": t.computed, "reused": t.reused,
                                                    "pattern": "".join("C" if c else "R" for c in t.pattern)}
                    for key, t in teas.items()}
        return {"cache_backend": self.name,
                "steps_computed": sum(t.computed for t in teas.values()),
                "steps_reused": sum(t.reused for t in teas.values()),
                "cache_branches": branches}

    # ------------------------------------------------------------------ hooks
    def _install(self, den: _Denoiser) -> None:
        module = den.module
        den.saved.append((module, module.__dict__.get("forward")))
        original = module.forward

        def transformer_forward(*args: Any, **kwargs: Any) -> Any:
            call = _Call(den, dict(forward_context().extras))
            token = _CURRENT.set(call)
            try:
                out = original(*args, **kwargs)
            finally:
                _CURRENT.reset(token)
            if self.record and call.segments:
                self._record_outputs(call, out)
            return out

        module.forward = transformer_forward
        last = len(den.blocks) - 1
        for i, block in enumerate(den.blocks):
            den.saved.append((block, block.__dict__.get("forward")))
            block.forward = self._block_forward(den, i, i == last, block.forward)

    def _block_forward(self, den: _Denoiser, i: int, last: bool, original: Any) -> Any:
        adapter = den.adapter
        params = adapter.params

        def forward(*args: Any, **kwargs: Any) -> Any:
            call = _CURRENT.get()
            if call is None or call.den is not den:
                return original(*args, **kwargs)
            a = dict(zip(params, args))
            a.update(kwargs)
            if i == 0:
                self._plan(call, a)
            if call.mode == "none":
                out = tuple(a[n] for n in adapter.outputs) if len(adapter.outputs) > 1 else a[adapter.hidden]
            elif call.mode == "slice":
                if i == 0:
                    for name in adapter.carried:
                        a[name] = a[name].index_select(0, call.index)
                for name in adapter.side:
                    a[name] = self._sliced(call, name, a.get(name))
                with use_forward_context(extras=call.sliced_extras):
                    out = original(**a)
            else:
                out = original(**a)
            return self._finish(call, out) if last else out

        return forward

    def _sliced(self, call: _Call, name: str, value: Any) -> Any:
        import torch

        if not isinstance(value, torch.Tensor) or value.shape[0] == 1:
            return value
        cached = call.sliced.get(name)
        if cached is not None and cached[0] is value:
            return cached[1]
        out = value.index_select(0, call.index)
        call.sliced[name] = (value, out)
        return out

    # ------------------------------------------------------------------ decisions
    def _segments(self, call: _Call, batch: int) -> list[_Segment]:
        ex, den = call.extras, call.den
        states, rows = ex.get("states"), ex.get("rows")
        branch, expert = ex.get("branch"), ex.get("expert")
        if states and rows and len(states) == len(rows) and sum(rows) == batch:
            n = len(states)
            branches = list(branch) if isinstance(branch, (list, tuple)) else [branch] * n
            experts = list(expert) if isinstance(expert, (list, tuple)) else [expert] * n
            segments, start = [], 0
            for state, r, br, exp in zip(states, rows, branches, experts):
                key = (br or "cond", exp or den.name)
                tea = state.cache_state.get(key)
                if not isinstance(tea, TeaState):
                    tea = state.cache_state[key] = TeaState(records=[] if self.record else None)
                segments.append(_Segment(state, start, start + r, key, tea))
                start += r
            return segments
        if states or rows:
            logger.debug("tea_cache: forward-context rows %s do not cover the batch of %d; one request assumed",
                         rows, batch)
        key = (branch if isinstance(branch, str) else "cond", expert if isinstance(expert, str) else den.name)
        tea = self._fallback.get((den.name, key))
        if tea is None:
            tea = self._fallback[(den.name, key)] = TeaState(records=[] if self.record else None)
        return [_Segment(None, 0, batch, key, tea)]

    def _plan(self, call: _Call, a: dict) -> None:
        import torch

        den, adapter = call.den, call.den.adapter
        hidden = a[adapter.hidden]
        batch = hidden.shape[0]
        segments = call.segments = self._segments(call, batch)
        call.in0 = {name: a[name] for name in adapter.carried}
        thresh = 0.0 if self.record else den.thresh
        rels: list[float | None] = [None] * len(segments)
        if thresh > 0 or self.record:
            rels = self._changes(adapter.modulated(den.module, den.blocks[0], a), segments)
        opts = self.options
        for seg, rel in zip(segments, rels):
            tea = seg.tea
            step, total = seg.step
            if self.record:
                tea.pending_rel = rel
            res = tea.residual
            force = (thresh <= 0 or rel is None or res is None or step < den.warmup
                     or (total is not None and step >= total - 1)
                     or res.shape != (seg.stop - seg.start, *hidden.shape[1:])
                     or (opts.max_consecutive_reuse is not None and tea.consecutive >= opts.max_consecutive_reuse))
            if force:
                compute = True
            else:
                tea.acc += _poly(den.coefficients, rel)
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
            call.index = torch.cat([torch.arange(s.start, s.stop, device=hidden.device)
                                    for s in segments if s.compute])
            extras = dict(forward_context().extras)
            for key in adapter.context_keys:
                value = extras.get(key)
                if isinstance(value, torch.Tensor) and value.shape[0] == batch:
                    extras[key] = value.index_select(0, call.index)
            call.sliced_extras = extras
        else:
            call.mode = "mask"
        self.mode_counts[call.mode] += 1

    def _can_slice(self, call: _Call, a: dict, batch: int) -> bool:
        import torch

        adapter = call.den.adapter
        if not adapter.can_slice(call.den.module):
            return False
        values = [a.get(n) for n in adapter.side] + [forward_context().extras.get(k) for k in adapter.context_keys]
        return all(not isinstance(v, torch.Tensor) or v.shape[0] in (batch, 1) for v in values)

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

        adapter = call.den.adapter
        multi = len(adapter.outputs) > 1
        outs = dict(zip(adapter.outputs, out)) if multi else {adapter.hidden: out}
        in0 = call.in0[adapter.hidden]
        h_out = outs[adapter.hidden]
        if call.mode == "all":
            for seg in call.segments:
                seg.tea.residual = h_out[seg.start:seg.stop] - in0[seg.start:seg.stop]
            return out
        pieces: dict[str, list] = {name: [] for name in outs}
        pos = 0
        for seg in call.segments:
            n = seg.stop - seg.start
            if seg.compute:
                lo, hi = (pos, pos + n) if call.mode == "slice" else (seg.start, seg.stop)
                pos += n
                for name, value in outs.items():
                    pieces[name].append(value[lo:hi])
                seg.tea.residual = h_out[lo:hi] - in0[seg.start:seg.stop]
            else:
                for name in outs:
                    if name == adapter.hidden:
                        pieces[name].append(in0[seg.start:seg.stop] + seg.tea.residual)
                    else:
                        pieces[name].append(call.in0[name][seg.start:seg.stop])
        full = {name: torch.cat(parts) for name, parts in pieces.items()}
        return tuple(full[n] for n in adapter.outputs) if multi else full[adapter.hidden]

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

"""``every_other``: a request computes the denoiser on steps 0, interval, 2 * interval, ... and reuses its
last output in between, per CFG branch and denoiser. It names no model: it puts a ``cache``-stage hook on
each declared denoiser (``DenoiserSpec.module``) in the core's hook registry, learns from the typed call
context which rows belong to which request and branch, and runs only the rows that compute (``batch_args``,
sliced with the core's row helpers) through the rest of the hook chain.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from omni_core.cache import CacheBackend
from omni_core.cache.rows import span_index, take_rows
from omni_core.forward_context import forward_context, use_forward_context
from omni_core.hooks import STAGES, FunctionHook, add_hook, remove_hook
from omni_core.options import validate_options
from omni_core.pipelines.denoiser import denoisers_of

from omni_cache_toy.hooks import OPTIONS

#: the name of this backend's hook in each denoiser's hook registry
HOOK = "every_other"


class EveryOtherStep(CacheBackend):
    name = "every_other"

    def enable(self, pipeline: Any) -> None:
        self.specs = denoisers_of(pipeline)
        for spec in self.specs:
            # the user's cache_config over what the model ships for this backend, over the record's default
            interval = validate_options({**spec.defaults_for(self.name), **self.config}, OPTIONS,
                                        prefix="cache_config.", owner="an every_other option")["interval"]
            # outside LoRA, compile and kernels, whatever order they were enabled in
            add_hook(spec.module, HOOK, FunctionHook(self._hook(spec, interval), order=STAGES["cache"]))
        super().enable(pipeline)

    def disable(self, pipeline: Any) -> None:
        for spec in getattr(self, "specs", []):
            remove_hook(spec.module, HOOK, missing_ok=True)  # the other hooks keep running
        super().disable(pipeline)

    def begin_request(self, state: Any) -> None:
        state.hook_state.clear()
        state.hook_state["every_other"] = {"outputs": {}, "computed": 0, "reused": 0}

    def request_metrics(self, state: Any) -> dict[str, Any]:
        mine = state.hook_state.get("every_other")
        return {"steps_computed": mine["computed"], "steps_reused": mine["reused"]} if mine else {}

    def _hook(self, spec: Any, interval: int) -> Any:
        """The hook's function: ``below`` runs the rest of the denoiser's chain (its own forward at the end)."""
        signature = inspect.signature(spec.module.forward)

        def cached_forward(below: Any, *args: Any, **kwargs: Any) -> Any:
            call = forward_context().call
            if call is None or any(g.state is None or "every_other" not in g.state.hook_state for g in call.groups):
                return below(*args, **kwargs)  # a call outside a request (e.g. a warm-up probe): compute it
            spans = call.spans()
            key = f"{call.expert or spec.name}/"  # one stored output per denoiser and CFG branch
            stores = [g.state.hook_state["every_other"] for g, _, _ in spans]
            reuse = [g.state.step_index % interval != 0 and key + g.branch in store["outputs"]
                     for (g, _, _), store in zip(spans, stores)]
            keep = [i for i, r in enumerate(reuse) if not r] if spec.rows_separable else list(range(len(spans)))
            computed = None
            if keep:
                bound = signature.bind(*args, **kwargs)
                index = span_index([(a, b) for i, (_, a, b) in enumerate(spans) if i in keep])
                for name in spec.batch_args:
                    if name in bound.arguments:
                        bound.arguments[name] = take_rows(bound.arguments[name], index, call.batch)
                with use_forward_context(call=call.select(keep)):
                    computed = below(*bound.args, **bound.kwargs)
                if not isinstance(computed, torch.Tensor):
                    raise TypeError(f"every_other needs a denoiser that returns a tensor; {spec.name!r} returned "
                                    f"{type(computed).__name__}")
            parts, row = [], 0
            for i, ((group, a, b), mine) in enumerate(zip(spans, stores)):
                if i in keep:
                    out, row = computed[row:row + b - a], row + b - a
                    if not reuse[i]:
                        mine["outputs"][key + group.branch] = out
                if reuse[i]:
                    out = mine["outputs"][key + group.branch]
                mine["reused" if reuse[i] else "computed"] += 1
                parts.append(out)
            return torch.cat(parts)

        return cached_forward

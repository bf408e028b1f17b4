"""``Omni``: the blocking Python API.

    with Omni("shapes") as omni:
        out = omni.generate("a red circle in the top left", seed=0)[0]
        out.images[0].save("out.png")

Several models share one device within a budget (docs/serving.md, "Several models"):

    with Omni(models={"img": "shapes", "vid": "/models/wan"}, residency={"device_budget": "20GiB"}) as omni:
        omni.generate("a red circle", model="img")
"""

from __future__ import annotations

import threading
from typing import Any

from omni_core.engine.client import EngineClient
from omni_core.entrypoints import weights
from omni_core.entrypoints.common import (as_prompt_list, build_requests, build_sampling_params_list, engine_for,
                                          start_models)
from omni_core.errors import RequestFailedError
from omni_core.outputs import DiffusionOutput


class Omni:
    def __init__(self, model: str | None = None, *, models: Any = None, residency: Any = None, **config: Any) -> None:
        #: several models: the ``ModelFleet`` that keeps them within ``residency`` (None for one model)
        self.fleet, self.engines = start_models(model, models, residency, config)
        #: the (first) model's engine, used only through its client interface
        self.engine: EngineClient = engine_for(self.engines, None)
        #: its engine config (``OmniDiffusionConfig``, checked)
        self.config = getattr(self.engine, "config", None)

    def generate(self, prompts: Any, sampling_params: Any = None, *, model: str | None = None, use_tqdm: bool = True,
                 **sampling_kwargs: Any) -> list[DiffusionOutput]:
        """One output per prompt, in order. Every request is validated before any is queued.

        ``sampling_params``: one ``SamplingParams`` (or dict) for every prompt, or -- vLLM's convention -- a list
        with one per prompt (different seeds, sizes or LoRA adapters in one call; compatible ones share a
        wave). Keyword arguments (``seed=0``) apply to every prompt. ``model``: which served model runs them
        (several models; None: the first)."""
        engine = engine_for(self.engines, model)
        prompts = as_prompt_list(prompts)
        params = build_sampling_params_list(sampling_params, sampling_kwargs, len(prompts))
        # validated here, once (submit does not check a prepared request again): the bar needs their step counts
        requests = [engine.prepare_request(r) for r in build_requests(prompts, params)]
        bar = _progress_bar(requests, use_tqdm)
        try:  # all at once, so compatible prompts share a wave
            handles = engine.submit(requests, on_progress=bar.step if bar is not None else None)
            outputs = [h.result() for h in handles]
        except BaseException:
            engine.abort([r.request_id for r in requests])
            raise
        finally:
            if bar is not None:
                bar.close()
        failed = [o for o in outputs if o.status == "error"]
        if failed:
            raise RequestFailedError("; ".join(f"request {o.request_id} failed: {o.error}" for o in failed), outputs)
        return outputs

    def stats(self, model: str | None = None) -> dict[str, Any]:
        return engine_for(self.engines, model).stats()

    def models(self) -> list[dict[str, Any]]:
        """Where each served model is (a fleet's ``states()``: device, host, cold, moving, dead; and its bytes)."""
        if self.fleet is None:
            return [{"name": name, "state": "dead" if e.is_dead else "device"} for name, e in self.engines.items()]
        return self.fleet.states()

    # ------------------------------------------------------------------ weights (RL trainers: docs/rollouts.md)
    update_weights = weights.update_weights
    update_lora = weights.update_lora
    encode = weights.encode
    weights_checksum = weights.weights_checksum
    release_memory = weights.release_memory
    resume_memory = weights.resume_memory

    def close(self) -> None:
        (self.fleet or self.engine).close()

    def __enter__(self) -> Omni:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _Bar:
    """A tqdm bar over the denoising steps of every request of one ``generate`` call."""

    def __init__(self, total: int) -> None:
        from tqdm.auto import tqdm

        self._bar = tqdm(total=total, desc="denoising", unit="step")
        self._lock = threading.Lock()

    def step(self, request_id: str, step: int, total: int) -> None:
        with self._lock:
            self._bar.update(1)

    def close(self) -> None:
        self._bar.close()


def _progress_bar(requests: list, enabled: bool) -> _Bar | None:
    if not enabled:
        return None
    try:
        return _Bar(sum(r.sampling_params.num_inference_steps or 0 for r in requests))
    except ImportError:
        return None

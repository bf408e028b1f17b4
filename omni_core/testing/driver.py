"""Drive a loaded pipeline step by step as the runner does, so contract suites and plugin tests share one loop.

* :func:`make_state` -- a ``StepState`` as the runner makes it (sampling params completed by the pipeline
  class, a generator seeded per request);
* :func:`make_states` -- one per prompt, seeded ``seed + i``, a parameter given as a list being per request;
* :func:`run_step_batch` -- step waves over several states, each admitted at its own wave (staggered requests
  at different steps share ``denoise_step`` calls), with an optional cache backend told of each request;
* :func:`run_request_batch` -- the request path: ``pipeline.forward`` over whole requests, the cache backend
  told of each request after it is encoded;
* :func:`output_tensors` -- either path under ``torch.inference_mode``, each request's output tensor (what a cache
  or model test compares);
* :func:`enabled_cache_backend` -- a cache backend by component name, enabled on a pipeline for a ``with``
  block and disabled after it (so a test never imports the backend's plugin).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence


def make_state(pipeline: Any, prompt: str, *, seed: int = 0, negative_prompt: str | None = None,
               model_path: str | None = None, images: Sequence[Any] | None = None, **params: Any):
    """A ``StepState`` for ``prompt`` with ``SamplingParams(seed=seed, **params)`` checked by the pipeline class.

    ``pipeline`` is a loaded pipeline or its class; ``model_path`` (default: the folder a loaded pipeline came
    from, ``pipeline.omni_model_path``) is handed to ``check_sampling_params``, as a model's size multiples and
    defaults can come from its folder; ``images`` (PIL images or ``[3, H, W]``
    uint8 tensors) are the request's input images, as the engine hands them to an edit or image-to-video model.
    """
    import torch

    from omni_core.config import SamplingParams
    from omni_core.images import to_tensor
    from omni_core.pipelines import StepState
    from omni_core.request import OmniDiffusionRequest

    cls = pipeline if isinstance(pipeline, type) else type(pipeline)
    if model_path is None:
        model_path = getattr(pipeline, "omni_model_path", None)
    sp = cls.check_sampling_params(SamplingParams(seed=seed, **params), model_path)
    request = OmniDiffusionRequest(prompt=prompt, negative_prompt=negative_prompt, sampling_params=sp,
                                   images=[im if isinstance(im, torch.Tensor) else to_tensor(im)
                                           for im in images or ()])
    return StepState(request=request, generator=torch.Generator("cpu").manual_seed(seed))


def make_states(pipeline: Any, prompts: Sequence[str], *, seed: int = 0, **params: Any) -> list[Any]:
    """A :func:`make_state` per prompt: request ``i`` seeded ``seed + i``; a parameter given as a list or tuple
    (e.g. ``num_inference_steps=[8, 10, 12]``) holds one value per request, any other value is shared."""
    for name, value in params.items():
        if isinstance(value, (list, tuple)) and len(value) != len(prompts):
            raise ValueError(f"{name} has {len(value)} values for {len(prompts)} prompts")
    return [make_state(pipeline, prompt, seed=seed + i,
                       **{k: v[i] if isinstance(v, (list, tuple)) else v for k, v in params.items()})
            for i, prompt in enumerate(prompts)]


def run_step_batch(pipeline: Any, states: Sequence[Any], admit_at: Sequence[int] | None = None, *,
                   cache_backend: Any = None) -> list[Any]:
    """Run ``states`` to completion in step waves; returns their ``DiffusionOutput`` in order.

    ``admit_at[i]`` is the wave at which state ``i`` is encoded and joins (default: all at wave 0), so later
    requests run alongside earlier ones that are steps ahead. ``cache_backend`` (an enabled
    ``CacheBackend``) gets ``begin_request`` for each state when it joins, as the runner does.
    """
    admit_at = list(admit_at) if admit_at is not None else [0] * len(states)
    if len(admit_at) != len(states):
        raise ValueError(f"admit_at has {len(admit_at)} entries for {len(states)} states")
    joined: list[Any] = []
    wave = 0
    while len(joined) < len(states) or any(not s.done for s in joined):
        for state, at in zip(states, admit_at):
            if at == wave:
                pipeline.prepare_encode(state)
                if cache_backend is not None:
                    cache_backend.begin_request(state)
                joined.append(state)
        active = [s for s in joined if not s.done]
        if active:
            for state, pred in zip(active, pipeline.denoise_step(active)):
                pipeline.step_scheduler(state, pred)
        wave += 1
    return [pipeline.post_decode(s) for s in states]


class _BeginRequests:
    """The ``StepControl`` a test needs: nothing stops, the cache backend begins each request when encoded."""

    def __init__(self, cache_backend: Any = None) -> None:
        self.cache_backend = cache_backend

    def stopped(self, request_ids: list[str]) -> set[str]:
        return set()

    def on_encoded(self, state: Any) -> None:
        if self.cache_backend is not None:
            self.cache_backend.begin_request(state)

    def on_step(self, state: Any) -> None:
        pass


def run_request_batch(pipeline: Any, states: Sequence[Any], *, cache_backend: Any = None) -> list[Any]:
    """Run ``states`` as one request batch (``pipeline.forward``); returns their ``DiffusionOutput`` in order."""
    return pipeline.forward(list(states), _BeginRequests(cache_backend))


def output_tensors(pipeline: Any, states: Sequence[Any], cache_backend: Any = None,
                   admit_at: Sequence[int] | None = None) -> list[Any]:
    """Each state's output tensor, in order: one request batch (:func:`run_request_batch`), or step waves
    (:func:`run_step_batch`) when ``admit_at`` is given, under ``torch.inference_mode`` as the runner runs."""
    import torch

    with torch.inference_mode():
        if admit_at is None:
            outputs = run_request_batch(pipeline, states, cache_backend=cache_backend)
        else:
            outputs = run_step_batch(pipeline, states, admit_at, cache_backend=cache_backend)
    return [o.tensor for o in outputs]


@contextlib.contextmanager
def enabled_cache_backend(name: str, pipeline: Any, **config: Any) -> Iterator[Any]:
    """The cache backend registered as ``name`` (e.g. ``"tea_cache"``), built from ``config`` and enabled on
    ``pipeline`` inside the block; disabled afterwards so the pipeline computes as before."""
    from omni_core.plugins.manager import get_plugin_manager

    backend = get_plugin_manager().load_component("cache", name)(config)
    backend.enable(pipeline)
    try:
        yield backend
    finally:
        if backend.is_enabled():
            backend.disable(pipeline)


def psnr(a: Any, b: Any, peak: float = 1.0) -> float:
    """Peak signal-to-noise ratio (dB) of ``b`` against ``a`` (inf when equal): how close a cached run stays."""
    import math

    mse = float(((a.float() - b.float()) ** 2).mean())
    return math.inf if mse == 0 else 10 * math.log10(peak ** 2 / mse)


def outputs_and_rows(pipeline: Any, states: Sequence[Any], counted: Any, backend: str | None = None) -> tuple[list, int]:
    """Each state's output tensor (one request batch, with the cache backend ``backend`` enabled if given) and the
    rows the module ``counted`` computed: a cache wraps the blocks' forward, so a module inside the last block (its
    attention, its feed-forward) counts only the rows really computed, not the skipped calls."""
    rows: list[int] = []

    def count(module: Any, args: tuple, kwargs: dict) -> None:
        rows.append((args[0] if args else kwargs["hidden_states"]).shape[0])

    hook = counted.register_forward_pre_hook(count, with_kwargs=True)
    try:
        if backend is None:
            return output_tensors(pipeline, states), sum(rows)
        with enabled_cache_backend(backend, pipeline) as b:
            return output_tensors(pipeline, states, b), sum(rows)
    finally:
        hook.remove()


__all__ = ["enabled_cache_backend", "make_state", "make_states", "output_tensors", "outputs_and_rows", "psnr",
           "run_request_batch", "run_step_batch"]

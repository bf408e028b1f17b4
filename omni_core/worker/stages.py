"""Pipeline stages apart from the denoiser: the text encoders (``encode_workers=1``) and the VAE decode
(``decode_workers=1``) each in a process of its own, on a device of its own (``encode_device`` /
``decode_device``: the model's first device, the CPU, or another device index).

Why: in line, the denoiser waits while a finished request is decoded and while a new one's prompt is encoded,
and the text encoder's and the VAE's weights sit next to the denoiser's. Split, the model process loads the
pipeline without the split stages' components (config-only stand-ins keep what the pipeline derives from a
diffusers model: ``vae_scale_factor``, the preview's VAE config; a text encoder is left out) and:

* **encode**: the engine sends each admitted request to the encode process first, which runs the pipeline's own
  ``encoded_prompts`` window on it (every text through the stage's embedding cache, each text alone: what the
  in-line pipeline computes with its cache) and sends back ``{text key: encoding}`` sealed
  (:class:`~omni_core.worker.transport.Sealed`: shared-memory handles, or with Ray refs into its object store,
  that the engine passes on unopened); it attaches them to the request (``request.text_encodings``) and only
  then queues it, so the encoder works on the next requests
  while the denoiser runs the current wave, and the pipeline's ``encoded_prompts`` in the model process reads
  the carried encodings instead of a text encoder. The encodings ride in the request through whatever executor
  carries requests (``mp``'s queues, Ray's object transfer across hosts).
* **decode**: a request that finishes denoising comes back as a sealed :class:`DecodePayload` (its final latents and the
  state fields decode reads) instead of pixels; the engine sends it to the decode process, which decodes it with
  the pipeline's own ``post_decode_batch`` exactly as in line (one call per call the runner made, so outputs are
  bit-equal) and the engine delivers what comes back. The denoiser's next wave runs meanwhile.

The contract a model meets (docs/runtime.md "Stages"; :mod:`omni_core.worker.stage_contract`):
``stage_components`` says which components each stage needs (a ``DiffusersStepPipeline`` derives it from its
folder's ``model_index.json``); ``encoded_prompts`` yields every text the states' ``prepare_encode`` reads when an
embedding cache is attached, and reads ``state.request.text_encodings`` when they are carried; ``post_decode_batch``
reads only the decode components, ``state.latents``, ``state.request`` and plain ``state.extra`` entries.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from omni_core.worker.stage_contract import ENCODE, DecodePayload, model_bytes_of_stage, stage_device
from omni_core.worker.transport import Sealed

logger = logging.getLogger("omni_core.worker")


# ---------------------------------------------------------------------------------------------- the process
def stage_main(stage: str, config: Any, resolved: Any, in_q: Any, out_q: Any, parent_pid: int,
               environment: dict[str, str] | None = None, seal: Any = None) -> None:
    """A stage's local process (``mp``, ``uni``): dies with the engine's process, runs :func:`run_stage`, exits."""
    from omni_core.processes import child_setup

    child_setup(parent_pid, environment, f"omni-{stage}")  # first of all: never outlive the engine
    if not run_stage(stage, config, resolved, in_q, out_q, seal):
        return
    from multiprocessing import util

    util._exit_function()  # multiprocessing's own exit work (semaphores such as tqdm's lock), as the model workers
    os._exit(0)  # skip the interpreter's teardown (seconds with torch loaded), as the model workers do


def run_stage(stage: str, config: Any, resolved: Any, in_q: Any, out_q: Any, seal: Any = None) -> bool:
    """A stage's whole life, wherever it runs (a local process, a Ray actor's thread): load that stage's components
    only, then run each batch of work it is sent (what waits in its inbox is taken together; the encode stage takes
    it by priority, then arrival, and sends each submit's requests back together as soon as they are encoded),
    until a shutdown; False if loading failed (reported as ``("fatal", 0, traceback)``). ``in_q`` needs ``get()``
    and ``empty()``, ``out_q`` ``put()``. Encodings leave sealed (:class:`~omni_core.worker.transport.Sealed`, as
    ``seal`` says: the executor's :class:`~omni_core.worker.transport.SealMode`, shared memory by default), decode
    payloads arrive sealed: the engine passes both on without rebuilding a tensor."""
    from omni_core.worker.mp_worker import BackgroundSender, _traceback

    sender = BackgroundSender(out_q)
    try:
        import torch

        from omni_core.pipelines.loader import load_pipeline
        from omni_core.platforms.threads import apply_thread_policy
        from omni_core.utils.dtypes import torch_dtype

        platform, device = _place(config, stage)
        budget = apply_thread_policy(config, processes=config.world_size)  # the in-line stage's threads
        # on the CPU, like the model process: one thread while the cores are contended (a 2-thread op waits at
        # the barrier for a descheduled thread: decode rounds 4-8x slower under load, bench/stages.py), unless
        # the user fixed the count (cpu_threads: then the same sums as in line, always)
        gauge = None
        if getattr(config, "cpu_threads", None) is None and device.type == "cpu":
            from omni_core.platforms.threads import ContentionGauge

            gauge = ContentionGauge()
        pipeline = load_pipeline(resolved, config, device, torch_dtype(config, platform), stage=stage)
        if stage == ENCODE:  # always a cache: it makes the window encode every text, each alone (see above)
            from omni_core.pipelines.embedding_cache import EmbeddingCache

            pipeline.embedding_cache = EmbeddingCache(getattr(config, "embedding_cache_bytes", 0))
        sender.put(("ready", 0, {"model_bytes": model_bytes_of_stage(pipeline), "device": str(device)}))
    except BaseException:  # noqa: BLE001 - reported to the engine
        sender.put(("fatal", 0, _traceback()))
        sender.close()
        return False
    while True:
        msgs = [in_q.get()]
        while not in_q.empty():  # what else waits is taken together
            msgs.append(in_q.get())
        # an abort always follows its request's work (one queue, the engine's lock): one that finds no work in
        # this batch came after the work was done, and is moot
        dropped = {rid for msg in msgs if msg[0] == "abort" for rid in msg[1]}
        work = [[x for x in msg[1] if _request_id(x) not in dropped] for msg in msgs if msg[0] == "work"]
        for msg in msgs:  # a dropped sealed payload is opened once and let go: that frees its shared memory
            for x in msg[1] if msg[0] == "work" else ():
                if _request_id(x) in dropped and isinstance(x, Sealed):
                    x.discard()
        if gauge is not None and torch.get_num_threads() != (n := gauge.threads(budget)):
            torch.set_num_threads(n)  # only when it changes: it also empties oneDNN's primitive cache
        if stage == ENCODE:
            # one submit's requests come back together (the engine queues them at once, so they may share a
            # wave, as submit promises), each submit as soon as it is encoded, the most urgent first
            def rank(r: Any) -> tuple:
                return r.sampling_params.priority, r.arrival_time

            for group in sorted((sorted(items, key=rank) for items in work if items), key=lambda g: rank(g[0])):
                sender.put(("done", _encode(pipeline, group, seal)))
        else:
            for payloads in work:
                if payloads:
                    sender.put(("done", _decode(pipeline, platform, device, payloads)))
        if any(m[0] == "shutdown" for m in msgs):
            break
    sender.close()
    return True


def _place(config: Any, stage: str) -> tuple[Any, Any]:
    """(platform, torch device) of a stage's process: ``<stage>_device`` "auto" is the model's first device,
    "cpu" the host (the CPU platform's memory figures), an index that device of the platform."""
    import torch

    from omni_core.errors import ConfigError
    from omni_core.platforms import platform_for

    platform = platform_for(config)
    where = stage_device(config, stage)
    if where == "cpu":
        from omni_core.platforms.cpu import CpuPlatform

        return (platform if platform.device_type == "cpu" else CpuPlatform()), torch.device("cpu")
    index = 0 if where == "auto" else int(where)
    if index >= max(1, platform.device_count()):
        raise ConfigError(f"{stage}_device={where!r}: platform {platform.name} has {platform.device_count()} "
                          f"device(s) (allowed: auto, cpu, 0..{platform.device_count() - 1})", field=f"{stage}_device")
    device = platform.get_torch_device(index)
    platform.set_device(device)
    return platform, device


def _request_id(item: Any) -> str:
    return item.meta["request_id"] if isinstance(item, Sealed) else item.request_id


def _encode(pipeline: Any, requests: list, seal: Any = None) -> dict:
    """``{"results": {request id: ("ok", sealed {text key: encoding on the host}) or ("error", message)}, "cache":
    the stage's embedding-cache stats}``: each request's texts through the pipeline's own window, as the model
    process would have encoded them with its cache."""
    import torch

    from omni_core.pipelines.embedding_cache import map_tensors
    from omni_core.pipelines.state import StepState

    results: dict = {}
    t0 = time.perf_counter()
    for request in requests:
        try:
            with torch.inference_mode(), pipeline.encoded_prompts([StepState(request=request)]) as memo:
                encodings = {k: map_tensors(v, lambda t: t.detach().to("cpu")) for k, v in dict(memo or {}).items()}
                results[request.request_id] = ("ok", Sealed.seal(encodings, mode=seal))
        except Exception as exc:  # noqa: BLE001 - this request fails, the others go on
            results[request.request_id] = ("error", f"encode stage: {type(exc).__name__}: {exc}")
    cache = getattr(pipeline, "embedding_cache", None)
    return {"results": results, "cache": cache.stats() if cache is not None else None,
            "encode_time_s": time.perf_counter() - t0}


def _decode(pipeline: Any, platform: Any, device: Any, sealed: list[Sealed]) -> Any:
    """One group decoded as the runner would have in line (a failing batch retried one by one), outputs packed
    for the trip back. The payloads are opened here, where they are used."""
    import torch

    payloads: list[DecodePayload] = [p.open() for p in sealed]
    from omni_core.waves import RunnerOutput
    from omni_core.worker.failures import batched_then_one_by_one, error_output
    from omni_core.worker.transport import pack_outputs

    states = [p.state(device) for p in payloads]
    try:
        platform.reset_peak_memory(device)
    except Exception:  # noqa: BLE001 - a platform that cannot tell
        pass
    t0 = time.perf_counter()
    try:
        with torch.inference_mode():
            results = batched_then_one_by_one(states, pipeline.post_decode_batch, pipeline.post_decode,
                                              lambda state, exc: exc, what="post_decode")
    except Exception as exc:  # noqa: BLE001
        results = [exc] * len(states)
    elapsed = time.perf_counter() - t0
    try:
        peak = round(platform.peak_memory_bytes(device) / 2**20, 1)
    except Exception:  # noqa: BLE001
        peak = 0.0
    outputs = {}
    for state, result in zip(states, results):
        if isinstance(result, Exception):
            result = error_output(state.request_id, RuntimeError(f"decode stage: {type(result).__name__}: {result}"),
                                  state)
        result.request_id = state.request_id
        result.metrics.update({"decode_time_s": elapsed, "decode_batch_size": len(states),
                               "decode_peak_memory_mb": peak})
        outputs[state.request_id] = result
    return pack_outputs(RunnerOutput(outputs=outputs))


__all__ = ["run_stage", "stage_main"]

"""What the engine holds for one admitted request (:class:`RequestRecord`), and what its final output says about it
(:func:`close_output`): the one table the engine keeps per request, and the one place its end is written up."""

from __future__ import annotations

import logging
import time

import attrs

from omni_core.engine.model_info import ProgressFn
from omni_core.engine.stream import OutputStream
from omni_core.outputs import DiffusionOutput
from omni_core.request import OmniDiffusionRequest
from omni_core.sched.interface import DiffusionRequestStatus

logger = logging.getLogger("omni_core.engine")


@attrs.define(eq=False)
class RequestRecord:
    """What the engine holds for one admitted request, from admission to its final output."""

    request: OmniDiffusionRequest
    stream: OutputStream
    #: ``time.monotonic()`` at admission, and when its first wave started
    arrival: float
    started: float | None = None
    #: the last denoising step reported for it, and of how many (the params' steps until the runner says)
    steps: int = 0
    on_progress: ProgressFn | None = None
    num_steps: int | None = None
    #: step waves holding it that were sent and not yet applied (the pipelined step loop)
    in_flight: int = 0
    #: when it must have ended (``time.monotonic()``; ``SamplingParams.timeout``), or None
    deadline: float | None = None
    #: it passed its deadline: its final output is a timeout error
    timed_out: bool = False
    #: the scheduler ended it while it ran (aborted, timed out): it ends once the runner has let it go
    ending: bool = False
    #: its steps' previews are streamed (``streaming_output`` and the request's ``stream_previews``)
    previews: bool = False
    #: the stage process it waits for (``"encode"`` before it is queued, ``"decode"`` after it denoised), or None
    stage: str | None = None
    #: the runner's output while it waits for its decode (its tensor a sealed decode payload)
    decoding: DiffusionOutput | None = None

    def step(self, out: DiffusionOutput) -> None:
        """A denoising step of it ran: progress, and (streaming previews) the step's output."""
        self.progress(out.step_index, out.num_steps)
        if self.previews:
            self.stream.put(out)

    def progress(self, step: int, total: int) -> None:
        """Note a denoising step and tell the request's listener (a broken listener never breaks the engine)."""
        self.steps, self.num_steps = step, total
        if self.on_progress is not None:
            try:
                self.on_progress(self.request.request_id, step, total)
            except Exception:  # noqa: BLE001 - a broken progress bar must not break the engine
                logger.debug("progress listener failed", exc_info=True)

    def last_step_preview(self, out: DiffusionOutput) -> DiffusionOutput:
        """The finishing step's preview as an intermediate output (streamed before the final one, so N steps
        stream N previews); the final output drops it."""
        preview = DiffusionOutput(request_id=out.request_id, finished=False, preview=out.preview,
                                  step_index=out.step_index, num_steps=out.num_steps,
                                  metrics={k: out.metrics[k] for k in ("step_time_s", "batch_size") if k in out.metrics})
        out.preview = None
        return preview


def close_output(record: RequestRecord, out: DiffusionOutput) -> DiffusionRequestStatus:
    """Make ``out`` the request's final output: a request past its deadline that did not complete says it timed
    out, and the metrics say how long it waited and ran. Returns its final status."""
    out.finished = True
    if record.timed_out and out.status != DiffusionRequestStatus.FINISHED_COMPLETED:
        timeout = record.request.sampling_params.timeout
        out.status, out.error = DiffusionRequestStatus.FINISHED_ERROR, (
            f"timed out: the request did not finish within its timeout of {timeout:g} s "
            f"(SamplingParams.timeout, the server's 'timeout' field)")
        out.metrics["timed_out"] = True
    out.metrics["e2e_latency_s"] = time.monotonic() - record.arrival
    out.metrics["steps_run"] = max(out.step_index, record.steps)
    if record.started is not None:
        out.metrics["queue_time_s"] = record.started - record.arrival
    return DiffusionRequestStatus.of_output(out.status)


def new_timing() -> dict:
    """Where the loop's time went, summed over waves (``count_wave``, ``timing_summary``)."""
    return {"waves": 0, "denoise_calls": 0, "wave_s": 0.0, "pipeline_s": 0.0, "denoise_s": 0.0,
            "denoiser_calls": 0, "denoiser_s": 0.0}


def count_wave(timing: dict, wall_s: float, metrics: dict) -> None:
    """Add one wave's wall time and the runner's time inside the pipeline to ``timing``."""
    timing["waves"] += 1
    timing["wave_s"] += wall_s
    for key in ("pipeline_s", "denoise_s", "denoiser_s"):
        timing[key] += metrics.get(key, 0.0)
    for key in ("denoise_calls", "denoiser_calls"):
        timing[key] += metrics.get(key, 0)
    for snap in metrics.get("embedding_cache", ()):  # each cache's latest cumulative counters, by cache
        timing.setdefault("embedding_caches", {})[snap.get("source")] = snap


def timing_summary(timing: dict) -> dict[str, float]:
    """``timing`` as ``engine.wave_timing()`` gives it: ``wave_s`` (wall time of waves, from scheduling to
    delivering their outputs), ``pipeline_s`` (inside the model's pipeline calls), ``denoise_s`` (inside
    ``denoise_step``), ``denoise_calls``, ``denoiser_s`` and ``denoiser_calls`` (inside the declared denoisers'
    forward, one call per CFG branch and expert; ``omni_core.worker.instrument``), and ``engine_s_per_step``: the
    engine's own time (``engine_s = wave_s - pipeline_s``: scheduling, transport, bookkeeping, events, delivery)
    per ``denoise_step`` call."""
    t = dict(timing)
    t.pop("embedding_caches", None)  # embedding_cache_summary
    t["engine_s"] = t["wave_s"] - t["pipeline_s"]
    t["engine_s_per_step"] = t["engine_s"] / t["denoise_calls"] if t["denoise_calls"] else 0.0
    return t


def embedding_cache_summary(timing: dict) -> dict[str, int]:
    """``stats()["embedding_cache"]``: hits, misses, entries, bytes, capacity_bytes and evictions of the text
    embedding caches the waves reported (:mod:`omni_core.pipelines.embedding_cache`), summed over replicas."""
    from omni_core.pipelines.embedding_cache import sum_embedding_caches

    return sum_embedding_caches((timing.get("embedding_caches") or {}).values())


__all__ = ["RequestRecord", "close_output", "count_wave", "embedding_cache_summary", "new_timing", "timing_summary"]

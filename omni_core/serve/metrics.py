"""Server metrics in the Prometheus text format, written by hand (no ``prometheus_client`` dependency).

The server keeps HTTP counters and latency histograms; engine gauges and counters (queue depth, running
requests, denoising steps) are read from ``DiffusionEngine.stats()`` at scrape time. Steps per second is a
gauge over a sliding window fed by :meth:`ServerMetrics.sample_steps` (the server samples once a second).
"""

from __future__ import annotations

import bisect
import collections
import threading
import time
from typing import Any, Iterable, Mapping

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
STEPS_WINDOW_S = 10.0


def _labels(labels: Mapping[str, Any]) -> str:
    if not labels:
        return ""
    esc = (str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") for v in labels.values())
    return "{" + ",".join(f'{k}="{v}"' for k, v in zip(labels, esc)) + "}"


def _num(value: float) -> str:
    if value == float("inf"):
        return "+Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


class Histogram:
    def __init__(self, buckets: Iterable[float] = LATENCY_BUCKETS) -> None:
        self.buckets = tuple(sorted(buckets))
        self.counts = [0] * (len(self.buckets) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str, labels: Mapping[str, Any]) -> list[str]:
        out, total = [], 0
        for bound, n in zip((*self.buckets, float("inf")), self.counts):
            total += n
            out.append(f"{name}_bucket{_labels({**labels, 'le': _num(bound)})} {total}")
        out.append(f"{name}_sum{_labels(labels)} {_num(self.sum)}")
        out.append(f"{name}_count{_labels(labels)} {self.count}")
        return out


class ServerMetrics:
    """Thread-safe counters and histograms of one server."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.http_requests: collections.Counter = collections.Counter()  # (method, path, status) -> n
        self.http_latency: dict[str, Histogram] = {}
        self.e2e_latency: dict[tuple[str, str], Histogram] = {}  # (model, kind) -> latencies
        self.queue_time: dict[str, Histogram] = {}  # model -> queue times
        self.client_disconnects = 0
        self.refused: collections.Counter = collections.Counter()  # reason -> n
        self._steps: dict[str, collections.deque] = {}  # model -> (monotonic time, its total steps)

    def observe_http(self, method: str, path: str, status: int, seconds: float) -> None:
        with self._lock:
            self.http_requests[(method, path, status)] += 1
            self.http_latency.setdefault(path, Histogram()).observe(seconds)

    def observe_generation(self, kind: str, metrics: Mapping[str, Any], *, model: str) -> None:
        """Engine-measured latencies of a completed request of ``model`` (``DiffusionOutput.metrics``)."""
        with self._lock:
            if "e2e_latency_s" in metrics:
                self.e2e_latency.setdefault((model, kind), Histogram()).observe(metrics["e2e_latency_s"])
            if "queue_time_s" in metrics:
                self.queue_time.setdefault(model, Histogram()).observe(metrics["queue_time_s"])

    def count_disconnect(self) -> None:
        with self._lock:
            self.client_disconnects += 1

    def count_refused(self, reason: str) -> None:
        with self._lock:
            self.refused[reason] += 1

    def sample_steps(self, total_steps: int, now: float | None = None, *, model: str) -> None:
        """``model``'s denoising-step counter now (the server samples each model once a second)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            steps = self._steps.setdefault(model, collections.deque())
            steps.append((now, total_steps))
            while len(steps) > 2 and now - steps[1][0] >= STEPS_WINDOW_S:
                steps.popleft()

    def steps_per_second(self, model: str) -> float:
        with self._lock:
            steps = self._steps.get(model, ())
            if len(steps) < 2:
                return 0.0
            (t0, s0), (t1, s1) = steps[0], steps[-1]
            return (s1 - s0) / (t1 - t0) if t1 > t0 else 0.0

    def render(self, stats_by_model: Mapping[str, Mapping[str, Any]], *, video_jobs: Mapping[str, int],
               residency: Iterable[Mapping[str, Any]] = ()) -> str:
        """The Prometheus exposition text: each model's engine state (``stats_by_model``: model -> its engine's
        ``stats()``), where each model is (``residency``: a fleet's ``states()``), and the server's own metrics.
        Every engine metric is labelled by model."""
        lines: list[str] = []
        per_model = sorted(stats_by_model.items())

        def each(value: Any) -> list[tuple[Mapping[str, Any], float]]:
            """One sample per model: ``value(stats)``, labelled ``model``."""
            return [({"model": name}, value(st)) for name, st in per_model]

        def each_labelled(samples: Any) -> list[tuple[Mapping[str, Any], float]]:
            """Samples per model: ``samples(stats)`` yields (labels, value), prefixed with ``model``."""
            return [({"model": name, **labels}, v) for name, st in per_model for labels, v in samples(st)]

        def metric(name: str, kind: str, help_: str, samples: Iterable[tuple[Mapping[str, Any], float]]) -> None:
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} {kind}")
            lines.extend(f"{name}{_labels(labels)} {_num(value)}" for labels, value in samples)

        def histogram(name: str, help_: str, hists: Iterable[tuple[Mapping[str, Any], Histogram]]) -> None:
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} histogram")
            for labels, h in hists:
                lines.extend(h.lines(name, labels))

        metric("omni_num_requests_waiting", "gauge", "Requests in the engine's queue (queue depth).",
               each(lambda st: st.get("waiting", 0)))
        metric("omni_num_requests_running", "gauge", "Requests the engine is running.",
               each(lambda st: st.get("running", 0)))
        metric("omni_engine_dead", "gauge", "1 when the engine's workers died.", each(lambda st: 1 if st.get("dead") else 0))
        metric("omni_engine_degraded", "gauge", "1 while the engine serves degraded (its last request to end ran out "
               "of memory; a completed request clears it).", each(lambda st: 1 if st.get("degraded") else 0))
        metric("omni_engine_requests_total", "counter", "Requests the engine admitted and how they ended.",
               each_labelled(lambda st: [({"outcome": k}, st.get(f"requests_{k}", 0))
                                         for k in ("added", "completed", "aborted", "failed")]))
        metric("omni_engine_requests_out_of_memory_total", "counter", "Requests that failed out of memory (also "
               "counted as failed).", each(lambda st: st.get("requests_out_of_memory", 0)))
        metric("omni_denoise_steps_total", "counter", "Denoising steps run (one per request per step).",
               each(lambda st: st.get("denoise_steps", 0)))
        metric("omni_denoise_steps_per_second", "gauge",
               f"Denoising steps per second over the last {STEPS_WINDOW_S:g} s.",
               [({"model": name}, self.steps_per_second(name)) for name, _ in per_model])
        with self._lock:
            metric("omni_http_requests_total", "counter", "HTTP requests by method, route and status code.",
                   [({"method": k[0], "path": k[1], "status": k[2]}, v) for k, v in sorted(self.http_requests.items())])
            histogram("omni_http_request_duration_seconds",
                      "Time from request to the end of the response (streams included).",
                      [({"path": p}, h) for p, h in sorted(self.http_latency.items())])
            histogram("omni_request_e2e_latency_seconds",
                      "Engine latency of completed generations, from admission to the final output.",
                      [({"model": mk[0], "kind": mk[1]}, h) for mk, h in sorted(self.e2e_latency.items())])
            histogram("omni_request_queue_time_seconds", "Time completed generations waited in the engine's queue.",
                      [({"model": name}, h) for name, h in sorted(self.queue_time.items())])
            metric("omni_client_disconnects_total", "counter",
                   "Clients that went away before their result (their requests were aborted).",
                   [({}, self.client_disconnects)])
            metric("omni_requests_refused_total", "counter", "Requests refused by reason.",
                   [({"reason": r}, n) for r, n in sorted(self.refused.items())] or [({"reason": "queue_full"}, 0)])
        metric("omni_model_bytes", "gauge", "Bytes of each model component's parameters and buffers on one rank "
               "(after quantization).", each_labelled(lambda st: [({"component": c}, b) for c, b in sorted(
                   (st.get("model_bytes") or {}).items())]))

        def cache(st: Mapping[str, Any]) -> Mapping[str, Any]:
            return st.get("embedding_cache") or {}

        metric("omni_embedding_cache_hits_total", "counter", "Text encodings read from the embedding cache (the "
               "text encoder skipped), summed over replicas.", each(lambda st: cache(st).get("hits", 0)))
        metric("omni_embedding_cache_misses_total", "counter", "Text encodings the embedding cache did not hold "
               "(the text encoder ran), summed over replicas.", each(lambda st: cache(st).get("misses", 0)))
        metric("omni_embedding_cache_entries", "gauge", "Text encodings the embedding cache holds.",
               each(lambda st: cache(st).get("entries", 0)))
        metric("omni_embedding_cache_bytes", "gauge", "Bytes of text encodings the embedding cache holds "
               "(its bound: embedding_cache_bytes per model process).",
               each_labelled(lambda st: [({"kind": "used"}, cache(st).get("bytes", 0)),
                                         ({"kind": "capacity"}, cache(st).get("capacity_bytes", 0))]))
        metric("omni_embedding_cache_evictions_total", "counter", "Text encodings the embedding cache evicted "
               "(least recently used first) to stay within its bytes.", each(lambda st: cache(st).get("evictions", 0)))

        def stages(st: Mapping[str, Any]) -> list:  # encode_workers / decode_workers: the stage processes
            return sorted((st.get("stages") or {}).items())

        metric("omni_stage_requests_waiting", "gauge", "Requests waiting for a stage process (encode: before they "
               "are queued; decode: after they finished denoising).",
               each_labelled(lambda st: [({"stage": k}, v.get("waiting", 0)) for k, v in stages(st)]))
        metric("omni_stage_requests_done_total", "counter", "Requests a stage process encoded or decoded.",
               each_labelled(lambda st: [({"stage": k}, v.get("done", 0)) for k, v in stages(st)]))
        metric("omni_stage_model_bytes", "gauge", "Bytes of each component a stage process holds.",
               each_labelled(lambda st: [({"stage": k, "component": c}, b) for k, v in stages(st)
                                         for c, b in sorted((v.get("model_bytes") or {}).items())]))
        metric("omni_stage_dead", "gauge", "1 when a stage process died (the engine dies with it).",
               each_labelled(lambda st: [({"stage": k}, 1 if v.get("dead") else 0) for k, v in stages(st)]))
        residency = list(residency)
        if residency:  # several models behind one server (omni_core.engine.fleet)
            metric("omni_model_state", "gauge", "1 for where each model is: device, host (weights kept in host "
                   "memory), cold (not loaded), loading, evicting, unloading, dead.",
                   [({"model": r["name"], "state": state}, 1 if r["state"] == state else 0)
                    for r in residency for state in ("device", "host", "cold", "loading", "evicting", "unloading", "dead")])
            metric("omni_model_residency_bytes", "gauge", "What each model counts against the device budget: its "
                   "weights (measured once loaded) and its working memory.",
                   [({"model": r["name"], "kind": k}, r[f"{k}_bytes"]) for r in residency for k in ("weight", "working")])
            metric("omni_model_loads_total", "counter", "Loads of each model from disk (restarts included).",
                   [({"model": r["name"]}, r["loads"]) for r in residency])
            metric("omni_model_restores_total", "counter", "Moves of each model from host memory to the device.",
                   [({"model": r["name"]}, r["restores"]) for r in residency])
        metric("omni_video_jobs", "gauge", "Video jobs in the job table by status.",
               [({"status": s}, n) for s, n in sorted(video_jobs.items())])
        return "\n".join(lines) + "\n"

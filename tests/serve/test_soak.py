"""No lost answer: a soak of 1000 requests on one ``mp`` engine, 500 over HTTP (16 concurrent clients) and 500
through the Python API (16 threads) at the same time, with random priorities, aborts, early client disconnects,
deadlines and a small queue (so some are refused). Every request gets exactly one terminal answer (checked by the
client's id), the server's and the engine's counters agree with what the clients saw, the engine holds nothing
afterwards and no process outlives it. Prints p50/p99 latency (not asserted: timings are not test material)."""

from __future__ import annotations

import asyncio
import queue
import random
import threading
import time
from collections import Counter

import httpx
import numpy as np

from omni_core.testing.processes import alive

N_HTTP = N_API = 500
CLIENTS = 16  # per front end: 32 in all
SLEEP_S = 0.001  # per request per step (the test pipeline's knob): a long request takes ~0.05 s of work
RETRIES = 200  # an API client's tries while the queue is full
KINDS = ("plain",) * 6 + ("abort", "leave", "deadline", "deadline")  # leave: over HTTP a disconnect, else an abort


def plan(n: int, seed: int) -> list[dict]:
    """Each request's kind, steps, priority and timings, from a seeded RNG."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        kind = rng.choice(KINDS)
        long = kind != "plain"
        out.append({"id": i, "kind": kind, "steps": rng.randint(20, 40) if long else rng.randint(2, 6),
                    "priority": rng.randint(-3, 3), "after": rng.uniform(0.0, 0.08),
                    "timeout": rng.uniform(0.02, 0.2) if kind == "deadline" else None})
    return out


def body(p: dict) -> dict:
    b = {"prompt": f"soak {p['id']}", "seed": p["id"], "num_inference_steps": p["steps"], "priority": p["priority"],
         "extra_args": {"sleep_per_step": SLEEP_S}}
    if p["timeout"] is not None:
        b["timeout"] = p["timeout"]
    return b


def http_soak(url: str, plans: list[dict]) -> dict[int, list]:
    """Each client id -> the terminal answers it got (status codes, or "left")."""
    answers: dict[int, list] = {p["id"]: [] for p in plans}

    async def main() -> None:
        sem = asyncio.Semaphore(CLIENTS)
        limits = httpx.Limits(max_connections=CLIENTS * 2, max_keepalive_connections=CLIENTS * 2)
        async with httpx.AsyncClient(base_url=url, limits=limits, timeout=120) as client:
            async def one(p: dict) -> None:
                async with sem:
                    task = asyncio.create_task(client.post("/v1/images/generations", json=body(p)))
                    if p["kind"] in ("leave", "abort"):  # an HTTP client aborts by going away
                        done, _ = await asyncio.wait({task}, timeout=p["after"])
                        if not done:
                            task.cancel()
                            await asyncio.gather(task, return_exceptions=True)
                            answers[p["id"]].append("left")
                            return
                    r = await task
                    while r.status_code == 429 and len(answers[p["id"]]) < RETRIES:  # full: a client retries
                        answers[p["id"]].append(429)
                        await asyncio.sleep(0.02)
                        r = await client.post("/v1/images/generations", json=body(p))
                    if r.status_code != 200:
                        assert r.json()["error"]["code"], r.text  # OpenAI's error shape, a code always
                    answers[p["id"]].append(r.status_code)

            await asyncio.gather(*(one(p) for p in plans))

    asyncio.run(main())
    return answers


def api_soak(engine, plans: list[dict]) -> tuple[dict[int, list], list[float]]:
    """Each client id -> its terminal answers ("completed", "aborted", "timed_out", "refused", ...); latencies."""
    from omni_core.config import SamplingParams
    from omni_core.errors import QueueFullError
    from omni_core.request import OmniDiffusionRequest

    answers: dict[int, list] = {p["id"]: [] for p in plans}
    latencies: list[float] = []
    todo: queue.SimpleQueue = queue.SimpleQueue()
    for p in plans:
        todo.put(p)

    def client() -> None:
        while True:
            try:
                p = todo.get_nowait()
            except queue.Empty:
                return
            sp = SamplingParams(seed=p["id"], num_inference_steps=p["steps"], priority=p["priority"],
                                timeout=p["timeout"], extra_args={"sleep_per_step": SLEEP_S})
            t0 = time.perf_counter()
            for _ in range(RETRIES):  # refused (the queue is full): a well-behaved client retries a little later
                try:
                    (handle,) = engine.submit([engine.prepare_request(OmniDiffusionRequest(prompt=f"api {p['id']}",
                                                                                           sampling_params=sp))])
                    break
                except QueueFullError:
                    answers[p["id"]].append("refused")
                    time.sleep(0.02)
            else:
                continue
            if p["kind"] in ("abort", "leave"):
                time.sleep(p["after"])
                handle.abort()
            out = handle.result(timeout=30)
            answers[p["id"]].append("timed_out" if out.metrics.get("timed_out") else getattr(out.status, "value",
                                                                                              out.status))
            try:  # exactly one terminal answer: nothing comes after it
                extra = handle.get(timeout=0.01)
                answers[p["id"]].append(f"extra:{extra.status}")
            except queue.Empty:
                pass
            if out.status == "completed":
                latencies.append(time.perf_counter() - t0)

    threads = [threading.Thread(target=client) for _ in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads), "an API client got no answer within 300 s"
    return answers, latencies


def metric_samples(text: str, name: str) -> dict[str, float]:
    """``{labels: value}`` of one metric in the Prometheus text."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            labels, value = line.rsplit(" ", 1)
            out[labels[len(name):]] = float(value)
    return out


def test_soak_1000_requests_32_clients_http_and_api_every_request_one_answer(tiny_model, capsys):
    from omni_core.config import OmniDiffusionConfig
    from omni_core.engine import make_engine
    from omni_core.serve import ServerThread, build_app

    engine = make_engine(OmniDiffusionConfig.from_kwargs(
        model=tiny_model, executor="mp", warmup=False, max_num_seqs=8, max_waiting_requests=28, cpu_threads=1,
        limits={"max_steps": 100}))
    workers = engine.executor.worker_pids()
    thread = ServerThread(build_app(engine))
    try:
        http_plans, api_plans = plan(N_HTTP, 1), plan(N_API, 2)
        results: dict = {}
        t0 = time.perf_counter()
        api = threading.Thread(target=lambda: results.update(api=api_soak(engine, api_plans)))
        api.start()
        http_answers = http_soak(thread.url, http_plans)
        api.join(300)
        wall = time.perf_counter() - t0
        api_answers, latencies = results["api"]

        # exactly one terminal answer per request, by id (a client's refused tries come before it)
        several = {i: a for i, a in http_answers.items() if [x for x in a if x != 429] != a[-1:]}
        several.update({i: a for i, a in api_answers.items() if [x for x in a if x != "refused"] != a[-1:]})
        assert not several, f"requests without exactly one terminal answer: {several}"
        http = Counter(a[-1] for a in http_answers.values())
        api_out = Counter(a[-1] for a in api_answers.values())
        http_refusals = sum(a.count(429) for a in http_answers.values())
        api_refusals = sum(a.count("refused") for a in api_answers.values())
        assert set(http) <= {200, 429, 504, "left"}, http
        assert set(api_out) <= {"completed", "aborted", "timed_out", "refused"}, api_out
        assert http[200] > N_HTTP // 2 and api_out["completed"] > N_API // 2 and http_refusals + api_refusals > 0, (http, api_out)
        assert http["left"] and api_out["aborted"] and (http[504] or api_out["timed_out"])
        for i, p in enumerate(http_plans):  # only a client that left or set a deadline misses its image
            assert http_answers[i][-1] in (200, 429) or p["kind"] != "plain", (p, http_answers[i])
        for i, p in enumerate(api_plans):
            assert api_answers[i][-1] in ("completed", "refused") or p["kind"] != "plain", (p, api_answers[i])

        # the engine holds nothing, and its books agree with the clients'
        deadline = time.monotonic() + 30
        while (stats := engine.stats())["tracked_requests"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stats["tracked_requests"] == [] and stats["waiting"] == stats["running"] == 0
        assert not stats.get("stages") and not stats["dead"]
        added = stats["requests_added"]
        assert added == stats["requests_completed"] + stats["requests_aborted"] + stats["requests_failed"]
        # a client that left before the server submitted its request was never admitted
        admissible = N_HTTP - http[429] + N_API - api_out["refused"]
        assert admissible - http["left"] <= added <= admissible
        assert stats["requests_timed_out"] == stats["requests_failed"] == http[504] + api_out["timed_out"]
        # a client that left after its image was made counts as completed there, else as aborted
        assert http[200] + api_out["completed"] <= stats["requests_completed"] <= (
            http[200] + api_out["completed"] + http["left"])
        assert stats["requests_aborted"] == added - stats["requests_completed"] - stats["requests_failed"]
        assert api_out["aborted"] <= stats["requests_aborted"] <= api_out["aborted"] + http["left"]
        text = httpx.get(thread.url + "/metrics").text
        statuses = {k: v for k, v in metric_samples(text, "omni_http_requests_total").items()
                    if 'path="/v1/images/generations"' in k}
        for code, n in ((200, http[200]), (429, http_refusals), (504, http[504])):
            # the server answered what each client saw, and may have answered a client that left at that moment
            counted = sum(v for k, v in statuses.items() if f'status="{code}"' in k)
            assert n <= counted <= n + http["left"], (code, n, statuses)
        disconnects = metric_samples(text, "omni_client_disconnects_total")
        assert sum(disconnects.values()) <= http["left"]
    finally:
        thread.stop()
        engine.close()
    deadline = time.monotonic() + 20
    while any(alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in workers), "a worker outlived its engine"
    with capsys.disabled():
        lat = np.array(latencies)
        print(f"\n[soak] {N_HTTP} HTTP + {N_API} API requests, {2 * CLIENTS} clients, {wall:.1f} s: HTTP {dict(http)} "
              f"({http_refusals} tries refused), "
              f"API {dict(api_out)} ({api_refusals} tries refused); API latency of completed p50 {np.percentile(lat, 50) * 1000:.0f} ms, "
              f"p99 {np.percentile(lat, 99) * 1000:.0f} ms")


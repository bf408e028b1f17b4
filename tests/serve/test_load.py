"""Load on loopback: 200 requests at concurrency 32, 10% of the clients disconnecting early.

Every request must be answered (200) or refused cleanly (429 with Retry-After, OpenAI error shape); the
disconnected ones are aborted; afterwards the engine tracks nothing. Prints p50/p99 latency (not asserted:
timings are not test material).
"""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import numpy as np

N_REQUESTS, CONCURRENCY = 200, 32
DISCONNECT = set(range(5, N_REQUESTS, 10))  # 20 clients = 10%
STEPS = 4


async def _request(client: httpx.AsyncClient, body: dict, stream: bool) -> tuple[int, dict]:
    """(status, info); raises AssertionError on anything that is not a clean answer or refusal."""
    if not stream:
        r = await client.post("/v1/images/generations", json=body)
        if r.status_code == 200:
            data = r.json()["data"]
            assert len(data) == 1 and data[0]["b64_json"]
        else:
            return _refusal(r.status_code, r.headers, r.json())
        return r.status_code, {}
    async with client.stream("POST", "/v1/images/generations", json={**body, "stream": True, "step_previews": True}) as r:
        if r.status_code != 200:
            return _refusal(r.status_code, r.headers, json.loads(await r.aread()))
        events = []
        async for line in r.aiter_lines():
            if line.startswith("event:"):
                events.append(line[6:].strip())
        assert events == ["image_generation.partial_image"] * body["num_inference_steps"] + [
            "image_generation.completed"], events
        return 200, {"events": len(events)}


def _refusal(status: int, headers, body: dict) -> tuple[int, dict]:
    assert status == 429, (status, body)
    assert headers.get("retry-after") and body["error"]["code"] == "queue_full"
    return status, {"retry_after": headers["retry-after"]}


def test_load_200_requests_concurrency_32_with_early_disconnects(tiny_model, start_server, wait_idle, capsys):
    live = start_server(tiny_model, {"streaming_output": True, "max_num_seqs": 8, "max_waiting_requests": 20})
    engine = live.engine
    before = engine.stats()
    rng = random.Random(0)
    delays = {i: rng.uniform(0.02, 0.3) for i in DISCONNECT}

    async def main():
        sem = asyncio.Semaphore(CONCURRENCY)
        limits = httpx.Limits(max_connections=CONCURRENCY * 2, max_keepalive_connections=CONCURRENCY * 2)
        async with live.async_client(limits=limits, timeout=120) as client:
            async def one(i: int):
                stream = i % 4 == 0  # a quarter of the clients stream previews
                body = {"prompt": f"load test {i}", "seed": i, "size": "16x16", "num_inference_steps": STEPS,
                        "extra_args": {"sleep_per_step": 0.002}}
                if i in DISCONNECT:  # long enough that leaving early really interrupts it
                    body["num_inference_steps"] = 100
                async with sem:
                    t0 = time.perf_counter()
                    task = asyncio.create_task(_request(client, body, stream))
                    if i in DISCONNECT:
                        done, _ = await asyncio.wait({task}, timeout=delays[i])
                        if not done:
                            task.cancel()  # closes the connection: the client is gone
                            await asyncio.gather(task, return_exceptions=True)
                            return i, "disconnected", time.perf_counter() - t0
                    status, info = await task
                    latency = time.perf_counter() - t0
                    if status == 429:  # a well-behaved client waits as told before its next request
                        await asyncio.sleep(float(info["retry_after"]))
                    return i, status, latency

            return await asyncio.gather(*(one(i) for i in range(N_REQUESTS)))

    t0 = time.perf_counter()
    results = asyncio.run(main())
    wall = time.perf_counter() - t0
    stats = wait_idle(engine, timeout=30)

    outcomes = [o for _, o, _ in results]
    assert len(results) == N_REQUESTS and set(outcomes) <= {200, 429, "disconnected"}
    assert all(o in (200, 429) for i, o, _ in results if i not in DISCONNECT)  # only leavers leave
    ok = np.array([lat for _, o, lat in results if o == 200])
    n_ok, n_refused, n_gone = outcomes.count(200), outcomes.count(429), outcomes.count("disconnected")
    assert n_ok >= N_REQUESTS // 2 and n_gone >= 1

    # nothing left behind, and the engine's books balance
    assert stats["tracked_requests"] == [] and stats["waiting"] == 0 and stats["running"] == 0
    added = stats["requests_added"] - before["requests_added"]
    completed = stats["requests_completed"] - before["requests_completed"]
    aborted = stats["requests_aborted"] - before["requests_aborted"]
    assert stats["requests_failed"] == before["requests_failed"]
    assert added == completed + aborted  # every admitted request ended, none failed
    assert n_ok + aborted <= added <= N_REQUESTS - n_refused  # a leaver may go before admission or after its end
    assert completed >= n_ok and aborted >= 1
    with live.client(key=None) as c:
        metrics = c.get("/metrics").text
    disconnects = int(next(line.split()[-1] for line in metrics.splitlines()
                           if line.startswith("omni_client_disconnects_total")))
    assert disconnects >= aborted

    with capsys.disabled():
        print(f"\n[load] {N_REQUESTS} requests, concurrency {CONCURRENCY}, {len(DISCONNECT)} leave early: "
              f"{n_ok} answered 200, {n_refused} refused 429, {n_gone} disconnected ({aborted} aborted in the "
              f"engine); latency of 200s p50 {np.percentile(ok, 50) * 1000:.0f} ms, "
              f"p99 {np.percentile(ok, 99) * 1000:.0f} ms; wall {wall:.1f} s; engine idle afterwards "
              f"(tracked={stats['tracked_requests']})")

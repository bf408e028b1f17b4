"""The HTTP server against real engines on the tiny test pipeline, over real loopback sockets."""

from __future__ import annotations

import json
import socket
import time

import numpy as np
import pytest

from omni_core.serve.errors import APIError
from omni_core.testing import sse_events, wait_for

API_KEY = "test-key"


# ------------------------------------------------------------------------------------------ helpers
def open_request(url: str, path: str, body: dict, key: str | None = API_KEY) -> socket.socket:
    """Send a POST over a raw socket and return the socket (read it, or close it to disconnect)."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n" + (f"Authorization: Bearer {key}\r\n" if key else "") + "\r\n")
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(head.encode() + data)
    return sock






def slow(steps: int = 200, sleep: float = 0.02, **extra) -> dict:
    return {"prompt": "slow", "num_inference_steps": steps, "extra_args": {"sleep_per_step": sleep}, **extra}


# ------------------------------------------------------------------------------------------ basics
def test_health_models_and_metrics_need_no_key_but_v1_does(server):
    with server.client(key=None) as c:
        assert c.get("/health").json()["status"] == "ok"
        assert c.get("/metrics").status_code == 200
        for method, path in [("GET", "/v1/models"), ("POST", "/v1/images/generations"), ("POST", "/v1/videos"),
                             ("GET", "/v1/videos/video_x")]:
            r = c.request(method, path, json={"prompt": "x"})
            assert r.status_code == 401, (method, path)
            assert r.json()["error"]["code"] == "invalid_api_key"
    with server.client(key="wrong") as c:
        assert c.get("/v1/models").status_code == 401
    with server.client() as c:
        (model,) = c.get("/v1/models").json()["data"]
    assert model["id"] == server.engine.config.model and model["object"] == "model"
    assert model["modality"] == "image" and model["streaming_previews"] is True
    with server.client() as c:
        assert c.get("/openapi.json").json()["info"]["title"] == "Omni"


def test_generate_images(server, decode_png):
    with server.client() as c:
        r = c.post("/v1/images/generations", json={"prompt": "a red circle", "n": 2, "size": "24x16", "seed": 3})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["size"] == "24x16" and body["seed"] == 3 and len(body["data"]) == 2
        a, b = (decode_png(d["b64_json"]) for d in body["data"])
        assert a.shape == (16, 24, 3) and not np.array_equal(a, b)
        again = c.post("/v1/images/generations", json={"prompt": "a red circle", "n": 2, "size": "24x16", "seed": 3})
        assert np.array_equal(decode_png(again.json()["data"][0]["b64_json"]), a)
        other = c.post("/v1/images/generations", json={"prompt": "a red circle", "size": "24x16", "seed": 4})
        assert not np.array_equal(decode_png(other.json()["data"][0]["b64_json"]), a)
        default = c.post("/v1/images/generations", json={"prompt": "defaults"}).json()
        assert default["size"] == "16x16" and isinstance(default["seed"], int)  # the model's size, a random seed


@pytest.mark.parametrize("body, status, param", [
    ({"n": 1}, 400, "prompt"),
    ({"prompt": "x", "size": "20x16"}, 400, "size"),  # the pipeline's multiple-of-8 rule, mapped back to size
    ({"prompt": "x", "size": "16by16"}, 400, "size"),
    ({"prompt": "x", "n": 99}, 400, "n"),
    ({"prompt": "x", "num_inference_steps": -1}, 400, "num_inference_steps"),
    ({"prompt": "x", "guidance_scale": "a lot"}, 400, "guidance_scale"),
    ({"prompt": "x", "seed": "42"}, 400, "seed"),
    ({"prompt": "x", "response_format": "url"}, 400, "response_format"),
    ({"prompt": "x", "style2": "vivid"}, 400, "style2"),
    ({"prompt": "x", "model": "dall-e-3"}, 404, "model"),
])
def test_invalid_requests_get_openai_errors_naming_the_field(server, body, status, param):
    before = server.engine.stats()["requests_added"]
    with server.client() as c:
        r = c.post("/v1/images/generations", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]
    assert server.engine.stats()["requests_added"] == before  # refused before reaching the engine


@pytest.mark.parametrize("content", [b"{not json", b"", b"[1, 2]"])
def test_malformed_bodies_get_400(server, content):
    with server.client() as c:
        r = c.post("/v1/images/generations", content=content, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_unknown_route_is_an_openai_shaped_404(server):
    with server.client() as c:
        r = c.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_a_failing_request_answers_500_and_leaves_nothing(server, wait_idle):
    with server.client() as c:
        r = c.post("/v1/images/generations", json={"prompt": "x", "extra_args": {"fail_at_step": 1}})
        assert r.status_code == 500
        assert r.json()["error"]["code"] == "generation_failed" and "injected failure" in r.json()["error"]["message"]
        with c.stream("POST", "/v1/images/generations",
                      json={"prompt": "x", "stream": True, "step_previews": True,
                            "extra_args": {"fail_at_step": 2}}) as s:
            events = sse_events(s)
    assert [e for e, _ in events] == ["image_generation.partial_image", "image_generation.partial_image", "error"]
    assert "injected failure" in events[-1][1]["error"]["message"]
    assert wait_idle(server.engine)["tracked_requests"] == []


# ------------------------------------------------------------------------------------------ streaming
def test_step_previews_stream_one_preview_per_step_then_the_same_final_image(server, tiny_model, start_server, decode_png):
    body = {"prompt": "a blue square", "seed": 11, "size": "32x32", "num_inference_steps": 5, "guidance_scale": 3.0,
            "negative_prompt": "red"}
    with server.client() as c:
        plain = decode_png(c.post("/v1/images/generations", json=body).json()["data"][0]["b64_json"])
        with c.stream("POST", "/v1/images/generations", json={**body, "stream": True, "step_previews": True}) as s:
            assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
            events = sse_events(s)
    partial = [d for e, d in events if e == "image_generation.partial_image"]
    final = [d for e, d in events if e == "image_generation.completed"]
    assert [e for e, _ in events] == ["image_generation.partial_image"] * 5 + ["image_generation.completed"]
    assert [d["partial_image_index"] for d in partial] == [0, 1, 2, 3, 4]
    assert [d["step"] for d in partial] == [1, 2, 3, 4, 5] and all(d["num_steps"] == 5 for d in partial)
    previews = [decode_png(d["b64_json"]) for d in partial]
    assert all(p.shape == (16, 16, 3) for p in previews)  # small: the pipeline's half-size latent projection
    assert len({p.tobytes() for p in previews}) == 5  # each step shows something new
    (done,) = final
    assert done["size"] == "32x32" and done["seed"] == 11
    streamed = decode_png(done["b64_json"])
    assert np.array_equal(streamed, plain)
    # and the same as an engine that does not stream at all (request-batch mode)
    batch = start_server(tiny_model, {"max_num_seqs": 2})
    assert batch.engine.execution_mode.value == "request_batch"
    with batch.client() as c:
        unstreamed = decode_png(c.post("/v1/images/generations", json=body).json()["data"][0]["b64_json"])
        refused = c.post("/v1/images/generations", json={**body, "stream": True})
    assert np.array_equal(streamed, unstreamed)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "stream"


def test_stream_of_n_images_ends_with_one_completed_event_each(server, decode_png):
    with server.client() as c:
        with c.stream("POST", "/v1/images/generations",
                      json={"prompt": "two", "n": 2, "seed": 5, "num_inference_steps": 2, "stream": True,
                            "step_previews": True}) as s:
            events = sse_events(s)
        plain = c.post("/v1/images/generations", json={"prompt": "two", "n": 2, "seed": 5,
                                                       "num_inference_steps": 2}).json()
    done = [d for e, d in events if e == "image_generation.completed"]
    assert [e for e, _ in events] == ["image_generation.partial_image"] * 2 + ["image_generation.completed"] * 2
    assert [d["step"] for e, d in events if e == "image_generation.partial_image"] == [1, 2]
    assert [d["index"] for d in done] == [0, 1]
    for d, p in zip(done, plain["data"]):
        assert np.array_equal(decode_png(d["b64_json"]), decode_png(p["b64_json"]))


# ------------------------------------------------------------------------------------------ disconnects
def test_client_disconnect_aborts_a_non_streamed_request(server, wait_idle):
    engine = server.engine
    before = engine.stats()
    sock = open_request(server.url, "/v1/images/generations", slow())
    wait_for(lambda: engine.stats()["running"] == 1, what="the request to run")
    time.sleep(0.1)
    sock.close()
    t0 = time.monotonic()
    stats = wait_idle(engine)
    assert stats["tracked_requests"] == [] and stats["running"] == 0 and stats["waiting"] == 0
    assert time.monotonic() - t0 < 3.0  # aborted, not run to its 200 steps x 20 ms
    assert stats["requests_aborted"] == before["requests_aborted"] + 1
    assert stats["requests_completed"] == before["requests_completed"]


def test_client_disconnect_aborts_a_streamed_request(server, wait_idle):
    engine = server.engine
    before = engine.stats()
    sock = open_request(server.url, "/v1/images/generations", slow(stream=True, step_previews=True))
    received = b""
    while b"image_generation.partial_image" not in received:
        received += sock.recv(65536)
    assert received.startswith(b"HTTP/1.1 200")
    sock.close()
    stats = wait_idle(engine)
    assert stats["tracked_requests"] == [] and stats["requests_aborted"] == before["requests_aborted"] + 1
    assert stats["requests_completed"] == before["requests_completed"]


def test_queued_request_of_a_gone_client_is_dropped_too(server, wait_idle):
    """Disconnects while waiting in the queue (behind a full wave) leave nothing behind either."""
    engine = server.engine
    before = engine.stats()
    socks = [open_request(server.url, "/v1/images/generations", slow()) for _ in range(6)]  # 4 run, 2 wait
    wait_for(lambda: engine.stats()["running"] == 4 and engine.stats()["waiting"] == 2, what="4 running, 2 waiting")
    for s in reversed(socks):
        s.close()
    stats = wait_idle(engine)
    assert stats["tracked_requests"] == [] and stats["requests_aborted"] == before["requests_aborted"] + 6


# ------------------------------------------------------------------------------------------ queue bound
def test_full_queue_answers_429_with_retry_after(tiny_model, start_server, wait_idle):
    live = start_server(tiny_model, {"streaming_output": True, "max_num_seqs": 1, "max_waiting_requests": 1},
                        retry_after_s=3)
    engine = live.engine
    running = open_request(live.url, "/v1/images/generations", slow())
    wait_for(lambda: engine.stats()["running"] == 1, what="one running")
    waiting = open_request(live.url, "/v1/images/generations", slow())
    wait_for(lambda: engine.stats()["waiting"] == 1, what="one waiting")
    with live.client() as c:
        r = c.post("/v1/images/generations", json={"prompt": "one too many"})
        assert r.status_code == 429 and r.headers["retry-after"] == "3"
        err = r.json()["error"]
        assert err["code"] == "queue_full" and err["type"] == "rate_limit_error" and "max_waiting_requests" in err["message"]
        s = c.post("/v1/images/generations", json={"prompt": "streamed too", "stream": True})
        assert s.status_code == 429
        metrics = c.get("/metrics").text
    assert 'omni_requests_refused_total{reason="queue_full"} 2' in metrics
    assert f'omni_num_requests_waiting{{model="{engine.config.model}"}} 1\n' in metrics
    running.close()
    waiting.close()
    assert wait_idle(engine)["tracked_requests"] == []
    with live.client() as c:  # room again
        assert c.post("/v1/images/generations", json={"prompt": "now"}).status_code == 200


# ------------------------------------------------------------------------------------------ metrics
def test_metrics_report_queue_running_latency_and_steps_per_second(server, check_exposition, wait_idle):
    engine = server.engine
    with server.client() as c:
        assert c.post("/v1/images/generations", json={"prompt": "quick"}).status_code == 200
    start = engine.counters["denoise_steps"]
    sock = open_request(server.url, "/v1/images/generations", slow(steps=1000, sleep=0.01))
    wait_for(lambda: engine.counters["denoise_steps"] >= start + 20, what="20 steps")
    time.sleep(1.2)  # the server samples the step counter once a second
    with server.client(key=None) as c:
        r = c.get("/metrics")
    sock.close()
    wait_idle(engine)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    types = check_exposition(text)
    for name, kind in [("omni_num_requests_waiting", "gauge"), ("omni_num_requests_running", "gauge"),
                       ("omni_denoise_steps_per_second", "gauge"), ("omni_denoise_steps_total", "counter"),
                       ("omni_request_e2e_latency_seconds", "histogram"),
                       ("omni_request_queue_time_seconds", "histogram"),
                       ("omni_http_request_duration_seconds", "histogram"), ("omni_http_requests_total", "counter")]:
        assert types.get(name) == kind, name
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line and not line.startswith("#")}
    model = server.engine.config.model
    assert samples[f'omni_num_requests_running{{model="{model}"}}'] == 1
    assert samples[f'omni_denoise_steps_per_second{{model="{model}"}}'] > 0
    assert samples[f'omni_denoise_steps_total{{model="{model}"}}'] >= start + 20
    assert samples[f'omni_request_e2e_latency_seconds_count{{model="{model}",kind="image"}}'] >= 1
    assert samples['omni_http_requests_total{method="POST",path="/v1/images/generations",status="200"}'] >= 1


def test_api_error_shape():
    err = APIError(429, "busy", code="queue_full", type="rate_limit_error", headers={"Retry-After": "1"})
    assert err.body() == {"error": {"message": "busy", "type": "rate_limit_error", "param": None,
                                    "code": "queue_full"}}


def test_build_app_takes_an_async_omni_and_runs_over_asgi_transport(tiny_model, decode_png):
    """No socket needed for plain request/response: httpx's ASGI transport drives the app in-process."""
    import asyncio

    import httpx

    from omni_core import AsyncOmni
    from omni_core.serve import build_app

    async def main():
        omni = AsyncOmni(tiny_model, streaming_output=True, warmup=False)
        try:
            app = build_app(omni, served_model_name="tiny")
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://omni") as c:
                r = await c.post("/v1/images/generations", json={"prompt": "x", "model": "tiny", "seed": 2})
                via_api = [o async for o in omni.generate("x", {"seed": 2, "output_type": "pt"})][-1]
            return r, via_api
        finally:
            await omni.close()

    r, via_api = asyncio.run(main())
    assert r.status_code == 200
    expected = (via_api.images[0].clamp(0, 1) * 255).round().byte().permute(1, 2, 0).numpy()
    assert np.array_equal(decode_png(r.json()["data"][0]["b64_json"]), expected)


# ------------------------------------------------------------------------------------------ engine death
def test_after_the_engine_dies_health_and_every_request_answer_503_engine_dead(tiny_model, start_server):
    """An embedded server (no exit on death) over an ``mp`` engine whose worker is SIGKILLed: the in-flight
    request, later requests and ``/health`` all say 503, in OpenAI's shape, the reason given once."""
    import os
    import signal
    import threading

    live = start_server(tiny_model, {"executor": "mp", "streaming_output": True, "warmup": False,
                                     "limits": {"max_steps": 1000}})
    engine = live.engine
    with live.client() as c:
        assert c.get("/health").status_code == 200
    answer = {}

    def in_flight() -> None:
        with live.client(timeout=60) as c:
            answer["r"] = c.post("/v1/images/generations", json=slow(steps=1000, sleep=0.05))

    thread = threading.Thread(target=in_flight)
    thread.start()
    wait_for(lambda: engine.stats()["running"] == 1, timeout=30, what="the request to run")
    (pid,) = engine.executor.worker_pids()
    os.kill(pid, signal.SIGKILL)
    thread.join(60)
    r = answer["r"]
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert (err["type"], err["code"], err["param"]) == ("engine_dead", "engine_dead", None)
    assert err["message"].startswith("the engine is dead: ") and err["message"].count("the engine is dead") == 1
    with live.client() as c:
        health = c.get("/health")
        later = c.post("/v1/images/generations", json={"prompt": "later"})
        metrics = c.get("/metrics").text
    assert health.status_code == 503 and health.json()["status"] == "dead"
    assert health.json()["reason"].count("the engine is dead") == 1
    assert later.status_code == 503 and later.json()["error"]["code"] == "engine_dead"
    assert later.json()["error"]["message"].count("the engine is dead") == 1
    assert f'omni_engine_dead{{model="{engine.config.model}"}} 1\n' in metrics
    assert live.thread._thread.is_alive()  # an embedded server keeps answering; omni serve exits instead

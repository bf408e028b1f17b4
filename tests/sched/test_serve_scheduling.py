"""The server's scheduling fields: ``priority``, ``timeout`` and the ``X-Request-Timeout`` header; a request past
its deadline answers 504 in OpenAI's error shape, and a stream ends with a timeout ``error`` event."""

from __future__ import annotations

import json
import time

import pytest

SLOW = {"prompt": "slow", "num_inference_steps": 200, "seed": 0, "extra_args": {"sleep_per_step": 0.04}}


@pytest.fixture(scope="module")
def live(tiny_model):
    import httpx

    from omni_core.config import OmniDiffusionConfig
    from omni_core.engine import make_engine
    from omni_core.serve import ServerThread, build_app

    engine = make_engine(OmniDiffusionConfig.from_kwargs(model=tiny_model, streaming_output=True, max_num_seqs=2,
                                                         warmup=False, cpu_threads=1, limits={"max_steps": 1000}))
    with ServerThread(build_app(engine)) as srv:
        with httpx.Client(base_url=srv.url, timeout=60) as client:
            yield engine, client
    engine.close()


def idle(engine):
    deadline = time.monotonic() + 10
    while engine.stats()["tracked_requests"] and time.monotonic() < deadline:
        time.sleep(0.02)
    return engine.stats()


def test_a_request_past_its_timeout_answers_504(live):
    engine, client = live
    for body, headers in [({**SLOW, "timeout": 0.3}, {}), (SLOW, {"X-Request-Timeout": "0.3"}),
                          ({**SLOW, "timeout": 100}, {"X-Request-Timeout": "0.3"})]:  # the smaller applies
        t0 = time.monotonic()
        r = client.post("/v1/images/generations", json=body, headers=headers)
        assert r.status_code == 504, r.text
        err = r.json()["error"]
        assert err["code"] == "request_timeout" and err["type"] == "timeout_error" and "timed out" in err["message"]
        assert time.monotonic() - t0 < 5  # not its 200 steps x 40 ms
    assert idle(engine)["tracked_requests"] == []


def test_a_streamed_request_past_its_timeout_ends_with_a_timeout_error_event(live):
    engine, client = live
    with client.stream("POST", "/v1/images/generations", json={**SLOW, "stream": True, "step_previews": True, "timeout": 0.3}) as r:
        assert r.status_code == 200
        text = "".join(r.iter_text())
    events = [block for block in text.split("\n\n") if block.strip()]
    assert "event: image_generation.partial_image" in events[0]  # it streamed steps, then
    last = events[-1]
    assert last.startswith("event: error")
    err = json.loads(last.split("data: ", 1)[1])["error"]
    assert err["code"] == "request_timeout" and "timed out" in err["message"]
    assert idle(engine)["tracked_requests"] == []


@pytest.mark.parametrize("body, headers, param", [
    ({"timeout": 0}, {}, "timeout"), ({"timeout": "soon"}, {}, "timeout"), ({"priority": 1.5}, {}, "priority"),
    ({}, {"X-Request-Timeout": "soon"}, "X-Request-Timeout"), ({}, {"X-Request-Timeout": "-1"}, "X-Request-Timeout"),
])
def test_bad_scheduling_fields_are_a_400_naming_them(live, body, headers, param):
    engine, client = live
    r = client.post("/v1/images/generations", json={"prompt": "p", **body}, headers=headers)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert engine.stats()["tracked_requests"] == []


def test_priority_is_a_request_field(live):
    engine, client = live
    r = client.post("/v1/images/generations", json={"prompt": "p", "priority": -3, "num_inference_steps": 2})
    assert r.status_code == 200, r.text


def until(condition, timeout=30):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.005)


def test_priority_sent_over_http_orders_the_queue(live):
    """Two requests of priority 5 and then one of priority -3 queue behind a full wave (capacity 2): the urgent
    one runs in the next wave, ahead of the second priority-5 one, which arrived before it."""
    import threading

    from omni_core import SamplingParams
    from omni_core.request import OmniDiffusionRequest

    engine, client = live
    blockers = engine.submit([OmniDiffusionRequest(prompt=f"blocker {i}", sampling_params=SamplingParams(
        seed=i, num_inference_steps=200, extra_args={"sleep_per_step": 0.04})) for i in range(2)])
    until(lambda: engine.stats()["running"] == 2)
    finished, threads = [], []

    def post(name, priority):
        r = client.post("/v1/images/generations", json={
            "prompt": name, "priority": priority, "seed": 1, "num_inference_steps": 6,
            "extra_args": {"sleep_per_step": 0.04}})
        finished.append((name, r.status_code))

    for n, (name, priority) in enumerate([("low1", 5), ("low2", 5), ("urgent", -3)], start=1):
        threads.append(threading.Thread(target=post, args=(name, priority)))
        threads[-1].start()
        until(lambda: engine.stats()["waiting"] == n)  # arrival order is the order sent
    for h in blockers:
        h.abort()
    for t in threads:
        t.join(60)
    assert [code for _, code in finished] == [200] * 3, finished
    order = [name for name, _ in finished]
    assert order.index("urgent") < order.index("low2"), f"finished in the order {order}: priority -3 was not used"
    assert idle(engine)["tracked_requests"] == []


def test_openapi_documents_the_fields_and_the_504(live):
    engine, client = live
    doc = client.get("/openapi.json").json()
    op = doc["paths"]["/v1/images/generations"]["post"]
    assert "504" in op["responses"]
    props = op["requestBody"]["content"]["application/json"]["schema"]["properties"]
    assert {"priority", "timeout"} <= set(props)


def test_scheduling_flags_reach_the_engine_config():
    import argparse

    from omni_core.cli.options import add_engine_options, engine_options
    from omni_core.config import OmniDiffusionConfig

    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    opts = engine_options(parser.parse_args(["--max-preemptions", "0", "--step-time-budget", "0.25"]))
    config = OmniDiffusionConfig.from_kwargs(model="shapes", **opts)
    assert (config.max_preemptions, config.step_time_budget_s) == (0, 0.25)
    assert not {"max_preemptions", "step_time_budget_s"} & set(engine_options(parser.parse_args([])))

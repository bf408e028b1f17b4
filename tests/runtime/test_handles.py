"""The engine's one admission path: ``submit(requests, on_progress=)`` -> one ``RequestHandle`` per request,
readable blocking or from asyncio whichever thread submitted; the request record table; the mode strategies;
the runner's batched-then-one-by-one isolation."""

from __future__ import annotations

import asyncio
import queue
import threading
import time

import pytest

from omni_core import Omni, SamplingParams
from omni_core.engine import DiffusionEngine, QueueFullError, RequestHandle
from omni_core.engine.client import EngineClient, ModelInfo
from omni_core.engine.modes import DiffusionExecutionMode, RequestBatchMode, StepBatchMode, mode_for
from omni_core.engine.stream import OutputStream
from omni_core.errors import ConfigError
from omni_core.request import OmniDiffusionRequest
from omni_core.worker.runner import batched_then_one_by_one


def req(prompt="p", rid=None, **params):
    return OmniDiffusionRequest.from_prompt(prompt, SamplingParams(**{"seed": 0, **params}), rid)


@pytest.fixture(scope="module")
def omni(tiny_model):
    with Omni(tiny_model, streaming_output=True, max_num_seqs=4, warmup=False) as omni:
        yield omni


def test_submit_returns_one_handle_per_request_in_order(omni):
    handles = omni.engine.submit([req("a", num_inference_steps=2), req("b", num_inference_steps=3)])
    assert all(isinstance(h, RequestHandle) for h in handles)
    assert [h.request.prompt for h in handles] == ["a", "b"]
    outs = [h.result(timeout=60) for h in handles]
    assert [(o.request_id, o.status, o.step_index) for o in outs] == [(handles[0].request_id, "completed", 2),
                                                                      (handles[1].request_id, "completed", 3)]
    assert handles[0].request.sampling_params.height is not None, "the handle holds the completed request"
    assert omni.stats()["tracked_requests"] == []


def test_submit_is_all_or_none(omni):
    before = omni.stats()
    with pytest.raises(ConfigError) as err:
        omni.engine.submit([req("fine"), req("   ")])
    assert err.value.field == "prompt"
    with pytest.raises(ConfigError, match="already in use") as err:
        omni.engine.submit([req("x", rid="same"), req("y", rid="same")])
    assert err.value.field == "request_id"
    after = omni.stats()
    assert after["requests_added"] == before["requests_added"] and after["tracked_requests"] == []


def test_submit_is_all_or_none_when_the_scheduler_refuses_one_midway(omni, monkeypatch):
    """A scheduler that raises on the second request leaves nothing of the first queued or tracked."""
    scheduler = omni.engine.scheduler
    real, seen = scheduler.add_request, []

    def add_request(request):
        seen.append(request.request_id)
        if len(seen) == 2:
            raise RuntimeError("scheduler refuses")
        return real(request)

    before = omni.stats()
    monkeypatch.setattr(scheduler, "add_request", add_request)
    with pytest.raises(RuntimeError, match="scheduler refuses"):
        omni.engine.submit([req("first", num_inference_steps=1), req("second", num_inference_steps=1)])
    monkeypatch.undo()
    deadline = time.monotonic() + 10  # the busy loop flushes the scheduler's finished list on its next round
    while omni.stats()["tracked_requests"] and time.monotonic() < deadline:
        time.sleep(0.01)
    after = omni.stats()
    assert after["requests_added"] == before["requests_added"] and after["tracked_requests"] == []
    assert after["waiting"] == 0 and scheduler.tracked_ids() == set()
    (handle,) = omni.engine.submit([req("later", num_inference_steps=1)])  # the engine goes on as before
    assert handle.result(timeout=60).status == "completed"


def test_submit_takes_a_list(omni):
    with pytest.raises(TypeError, match=r"submit\(\[request\]\)"):
        omni.engine.submit(req())


def test_on_progress_given_at_submit_sees_every_step_from_the_first(omni):
    """No race with a fast request: the listener is part of the record from admission on."""
    seen = []
    (handle,) = omni.engine.submit([req(num_inference_steps=3)], on_progress=lambda rid, s, t: seen.append((s, t)))
    assert handle.result(timeout=60).status == "completed"
    assert seen == [(1, 3), (2, 3), (3, 3)]


def test_progress_is_sent_at_most_once_per_interval_and_always_at_the_end(tiny_model, monkeypatch):
    """Where each progress delivery is a message (a worker process), the request path's runner batches the
    events of the steps run since the last one; the wave's end sends the rest: nothing lost, none late."""
    with Omni(tiny_model, warmup=False) as omni:  # request mode (streaming would mean step mode)
        runner = omni.engine.executor.runner
        calls = []
        deliver = runner.on_progress
        monkeypatch.setattr(runner, "on_progress", lambda events: (calls.append([e[1] for e in events]),
                                                                    deliver(events)))
        monkeypatch.setattr(runner, "progress_interval_s", 3600.0)
        seen = []
        (handle,) = omni.engine.submit([req(num_inference_steps=4)], on_progress=lambda rid, s, t: seen.append(s))
        assert handle.result(timeout=60).status == "completed"
        assert calls == [[1], [2, 3, 4]]  # the first at once, the rest at the wave's end
        assert seen == [1, 2, 3, 4]
        calls.clear()
        monkeypatch.setattr(runner, "progress_interval_s", 0.0)  # in-process (uni): after every step
        (handle,) = omni.engine.submit([req(num_inference_steps=3)])
        assert handle.result(timeout=60).status == "completed"
        assert calls == [[1], [2], [3]]


def test_a_handle_submitted_on_a_thread_is_read_from_asyncio_and_vice_versa(omni):
    (handle,) = omni.engine.submit([req(num_inference_steps=2)])  # no loop here

    async def read():
        return [out async for out in handle]

    outs = asyncio.run(read())
    assert [o.finished for o in outs] == [False, False, True] and outs[-1].status == "completed"

    async def submit_in_a_loop():
        return omni.engine.submit([req(num_inference_steps=2)])[0]

    handle = asyncio.run(submit_in_a_loop())  # its loop is gone: a blocking reader still gets everything
    assert handle.result(timeout=60).status == "completed"
    assert omni.stats()["tracked_requests"] == []


def test_leaving_an_async_iteration_early_aborts_the_request(omni):
    before = omni.stats()["requests_aborted"]

    async def first_then_leave():
        (handle,) = omni.engine.submit([req(num_inference_steps=50, extra_args={"sleep_per_step": 0.05})])
        async for out in handle:
            assert not out.finished
            break
        return handle

    asyncio.run(first_then_leave())
    stats = _idle(omni)
    assert stats["requests_aborted"] == before + 1 and stats["tracked_requests"] == []


def test_handle_abort_ends_the_request_aborted(omni):
    (handle,) = omni.engine.submit([req(num_inference_steps=50, extra_args={"sleep_per_step": 0.05})])
    assert not handle.get(timeout=60).finished  # running
    handle.abort()
    out = handle.result(timeout=60)
    assert out.status == "aborted" and out.metrics["steps_run"] < 50
    handle.abort()  # ended: a no-op
    assert _idle(omni)["tracked_requests"] == []


def test_a_get_timeout_raises_queue_empty():
    with pytest.raises(queue.Empty):
        OutputStream().get(timeout=0.01)


def test_a_second_concurrent_async_reader_is_refused_not_left_waiting():
    stream = OutputStream()

    async def main():
        first = asyncio.ensure_future(stream.aget())
        await asyncio.sleep(0.01)  # the first reader is waiting
        with pytest.raises(RuntimeError, match="already has an async reader"):
            await stream.aget()
        stream.put("x")
        return await asyncio.wait_for(first, 10)

    assert asyncio.run(main()) == "x"


def test_a_stream_wakes_an_asyncio_reader_from_another_thread():
    stream = OutputStream()

    async def main():
        threading.Timer(0.05, stream.put, args=("x",)).start()
        return await asyncio.wait_for(stream.aget(), 10)

    assert asyncio.run(main()) == "x"


def test_the_engine_is_an_engine_client_and_describes_its_model(omni, tiny_model):
    engine = omni.engine
    assert isinstance(engine, DiffusionEngine) and isinstance(engine, EngineClient)
    info = engine.model_info
    assert isinstance(info, ModelInfo)
    assert (info.model, info.pipeline, info.is_video, info.streaming) == (tiny_model, "TinyTestPipeline", False, True)
    assert info.model_path and info.provider and info.size_multiple >= 1 and info.frame_multiple >= 1
    assert engine.dead_reason is None and not engine.is_dead
    with pytest.raises(AttributeError):
        info.model = "other"  # frozen


def test_queue_full_error_is_the_errors_module_class():
    import omni_core.engine
    import omni_core.errors

    assert omni_core.engine.QueueFullError is omni_core.errors.QueueFullError is QueueFullError


def test_the_mode_strategy_is_chosen_once_from_the_config(omni, tiny_model):
    assert isinstance(omni.engine.mode, StepBatchMode) and omni.engine.execution_mode is DiffusionExecutionMode.STEP_BATCH
    assert omni.engine.stats()["execution_mode"] == "step_batch"

    class Config:
        uses_step_execution = False

    class NoStep:
        supports_step_execution = False
        supports_request_batch = False

    mode = mode_for(Config(), NoStep, "NoStep")
    assert isinstance(mode, RequestBatchMode) and mode.capacity(NoStep, 8) == 1
    Config.uses_step_execution = True
    with pytest.raises(ConfigError, match="'NoStep' does not support step execution") as err:
        mode_for(Config(), NoStep, "NoStep")
    assert err.value.field == "step_execution"


def test_batched_then_one_by_one_isolates_the_failing_item():
    calls = []

    def batched(items):
        calls.append(list(items))
        raise ValueError("batch")

    def alone(item):
        calls.append([item])
        if item == 2:
            raise RuntimeError("two")
        return item * 10

    results = batched_then_one_by_one([1, 2, 3], batched, alone, lambda item, exc: f"{item}: {exc}", what="t")
    assert results == [10, "2: two", 30] and calls == [[1, 2, 3], [1], [2], [3]]
    # a single item is not run twice: it fails at once
    calls.clear()
    assert batched_then_one_by_one([5], batched, alone, lambda item, exc: str(exc), what="t") == ["batch"]
    assert calls == [[5]]
    assert batched_then_one_by_one([1, 2], lambda items: [i + 1 for i in items], alone, None, what="t") == [2, 3]


def _idle(omni, timeout=10.0):
    import time

    deadline = time.monotonic() + timeout
    while (stats := omni.stats())["tracked_requests"] and time.monotonic() < deadline:
        time.sleep(0.02)
    return stats

"""The multi-process executor for real: spawn, gloo, shared-memory results, abort, worker death."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import numpy as np
import pytest

from omni_core import Omni, SamplingParams
from omni_core.request import OmniDiffusionRequest
from omni_core.testing import abort_after_steps

pytestmark = pytest.mark.dist

PROMPTS = ["a red circle", {"prompt": "a blue square", "negative_prompt": "blurry"}, "a green cross"]


def pixels(out):
    return np.stack([np.asarray(im, dtype=np.int16) for im in out.images])


def final(stream, timeout=60):
    while True:
        out = stream.get(timeout=timeout)
        if out.finished:
            return out


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead too
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def reference(tiny_model):
    with Omni(tiny_model, warmup=False) as omni:
        return omni.generate(PROMPTS, seed=11, guidance_scale=2.5, use_tqdm=False)


@pytest.mark.parametrize("config", [
    {"max_num_seqs": 4},
    {"step_execution": True, "max_num_seqs": 4},
    {"max_num_seqs": 1, "parallel_config": {"cfg_parallel_size": 2}},
    {"max_num_seqs": 4, "parallel_config": {"data_parallel_size": 2}},
    {"step_execution": True, "max_num_seqs": 4, "parallel_config": {"data_parallel_size": 2}},
], ids=["request-batch", "step-batch", "two-workers", "data-parallel", "data-parallel-step"])
def test_mp_matches_in_process_output(tiny_model, reference, config):
    with Omni(tiny_model, executor="mp", **config) as omni:
        outs = omni.generate(PROMPTS, seed=11, guidance_scale=2.5, use_tqdm=False)
        pids = omni.engine.executor.worker_pids()
        assert len(pids) == omni.config.world_size
        for a, b in zip(outs, reference):
            assert np.array_equal(pixels(a), pixels(b))
        if omni.config.parallel_config.data_parallel_size == 2:
            # the two compatible prompts of one wave went to different replicas
            assert {outs[0].metrics["batch_size"], outs[2].metrics["batch_size"]} == {1}
        assert omni.stats()["tracked_requests"] == []
    assert not any(alive(p) for p in pids)


def test_abort_reaches_the_worker_mid_request(tiny_model):
    with Omni(tiny_model, executor="mp", warmup=False) as omni:
        engine = omni.engine
        req = OmniDiffusionRequest(prompt="slow", sampling_params=SamplingParams(
            num_inference_steps=60, extra_args={"sleep_per_step": 0.15}))  # > the progress interval
        stream, at_abort = abort_after_steps(engine, req)
        out = final(stream)
        assert out.status == "aborted" and out.metrics["steps_run"] <= at_abort + 2
        assert omni.stats()["tracked_requests"] == []


def test_abort_reaches_each_requests_own_replica_in_request_mode(tiny_model):
    """Two data-parallel replicas, one slow request each (request mode: a wave runs its requests to the end unless
    the worker is told): aborting both stops both within a few steps, the one on replica 1 too."""
    with Omni(tiny_model, executor="mp", max_num_seqs=2, parallel_config={"data_parallel_size": 2},
              warmup=False, cpu_threads=1) as omni:
        engine = omni.engine
        reqs = [OmniDiffusionRequest(prompt=f"slow {i}", sampling_params=SamplingParams(
            # 0.25 s a step: the bound below is 5 steps after the progress seen at the abort, and on a loaded CI
            # machine progress and the abort took ~0.8 s to cross (9 steps run at 0.1 s a step, 1 seen)
            seed=i, num_inference_steps=60, extra_args={"sleep_per_step": 0.25})) for i in range(2)]
        seen: dict[str, list[int]] = {r.request_id: [] for r in reqs}
        streams = engine.submit(reqs, on_progress=lambda rid, step, total: seen[rid].append(step))
        deadline = time.monotonic() + 60
        while not all(seen.values()):
            assert time.monotonic() < deadline, f"both replicas should be running a request (saw {seen})"
            time.sleep(0.005)
        replicas = dict(engine.executor._assigned)
        assert sorted(replicas.values()) == [0, 1], replicas
        at_abort = {rid: len(steps) for rid, steps in seen.items()}
        for r in reqs:
            engine.abort(r.request_id)
        for r, stream in zip(reqs, streams):
            out = final(stream)
            assert out.status == "aborted", (replicas[r.request_id], out.status)
            assert out.metrics["steps_run"] <= at_abort[r.request_id] + 5, (replicas[r.request_id], out.metrics)
        assert omni.stats()["tracked_requests"] == []


def test_progress_from_a_worker_reports_every_step_in_fewer_messages(tiny_model):
    """A worker batches a request's progress events (at most one message per ``PROGRESS_INTERVAL_S``, as
    tqdm refreshes; how often depends on the step time, see ``test_handles``): the listener still sees every
    step, in order, and no event is lost or repeated."""
    from omni_core.worker.mp_worker import PROGRESS_INTERVAL_S

    with Omni(tiny_model, executor="mp", warmup=False) as omni:
        engine = omni.engine
        executor = engine.executor
        messages = []
        get_result = executor.group.receive

        def counting(timeout):
            msg = get_result(timeout)
            if msg[0] == "progress":
                messages.append(len(msg[1]))
            return msg

        executor.group.receive = counting
        steps = 12
        req = OmniDiffusionRequest(prompt="p", sampling_params=SamplingParams(
            num_inference_steps=steps, extra_args={"sleep_per_step": PROGRESS_INTERVAL_S / 4}))
        seen = []
        (stream,) = engine.submit([req], on_progress=lambda rid, step, total: seen.append((step, total)))
        out = final(stream)
    assert out.status == "completed"
    assert seen == [(s, steps) for s in range(1, steps + 1)]
    assert sum(messages) == steps and len(messages) <= steps, messages


def test_killed_worker_fails_every_request_quickly_and_leaves_no_process(tiny_model):
    omni = Omni(tiny_model, executor="mp", parallel_config={"cfg_parallel_size": 2}, warmup=False)
    engine = omni.engine
    pids = engine.executor.worker_pids()
    slow = SamplingParams(num_inference_steps=200, extra_args={"sleep_per_step": 0.05})
    streams = [engine.submit([OmniDiffusionRequest(prompt=f"p{i}", sampling_params=slow)])[0] for i in range(3)]
    time.sleep(1.0)
    t0 = time.monotonic()
    os.kill(pids[1], signal.SIGKILL)
    outs = [final(s, timeout=15) for s in streams]
    assert time.monotonic() - t0 < 10
    assert all(o.status == "error" and "engine is dead" in o.error for o in outs)
    with pytest.raises(Exception, match="engine is dead"):
        omni.generate("later", use_tqdm=False)
    assert omni.stats()["tracked_requests"] == []
    t1 = time.monotonic()
    omni.close()
    assert time.monotonic() - t1 < 15
    assert not any(alive(p) for p in pids)
    assert not [c for c in multiprocessing.active_children() if c.name.startswith("omni-worker")]


def test_the_workers_receiver_hands_over_waves_in_order_and_stops_at_shutdown_or_a_broken_pipe():
    import collections
    import queue

    from omni_core.worker.mp_worker import BackgroundReceiver

    tasks: queue.Queue = queue.Queue()
    inbox = BackgroundReceiver(tasks)
    for i in range(3):
        tasks.put(("step", i))
    assert inbox.get() == ("step", 0)
    taken: collections.deque = collections.deque()
    deadline = time.monotonic() + 5
    while len(taken) < 2 and time.monotonic() < deadline:  # what has been read, without waiting for more
        inbox.take_ready(taken)
    assert list(taken) == [("step", 1), ("step", 2)]
    tasks.put(("shutdown",))
    assert inbox.get() == ("shutdown",)
    inbox._thread.join(5)
    assert not inbox._thread.is_alive()

    class Broken:  # the engine's end of the pipe is gone
        def get(self):
            raise EOFError

    broken = BackgroundReceiver(Broken())
    assert broken.get() == ("shutdown",)
    broken._thread.join(5)
    assert not broken._thread.is_alive()

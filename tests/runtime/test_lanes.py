"""CPU lanes: a wave of several requests runs as one sub-batch per core, side by side, one torch thread each
(``omni_core.worker.lanes``). What a user sees is the same as one call: the same outputs, every request's
progress, a failure confined to its request, and nothing that would need autograd or a second process."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from omni_core import Omni, SamplingParams
from omni_core.config import OmniDiffusionConfig
from omni_core.request import OmniDiffusionRequest
from omni_core.worker.lanes import CpuLanes, lanes_allowed


def requests(n: int, steps: int = 3, **extra) -> list[OmniDiffusionRequest]:
    return [OmniDiffusionRequest(prompt=f"p{i}", sampling_params=SamplingParams(
        seed=i, num_inference_steps=steps, output_type="pt", extra_args=extra if i == 1 else {})) for i in range(n)]


def run(model, n=4, step=True, threads=2, **extra):
    with Omni(model, step_execution=step, max_num_seqs=n, cpu_threads=threads, warmup=False) as omni:
        log = omni.engine.executor.runner.pipeline.denoise_log
        log.clear()
        outs = [h.result(timeout=120) for h in omni.engine.submit(requests(n, **extra))]
        return outs, [dict(call) for call in log]


@pytest.mark.parametrize("step", [True, False], ids=["step", "request"])
def test_a_wave_runs_as_one_sub_batch_per_core_with_the_same_results(tiny_model, step):
    split, calls = run(tiny_model, step=step, threads=2)
    whole, whole_calls = run(tiny_model, step=step, threads=1)
    assert all(len(c) == 4 for c in whole_calls)  # one thread: one call per step holds the wave
    assert sorted(len(c) for c in calls) == [2] * len(calls) and len(calls) == 2 * len(whole_calls)
    for a, b in zip(split, whole):
        assert a.status == b.status == "completed"
        torch.testing.assert_close(a.images[0], b.images[0], rtol=0, atol=1e-5)
        assert not a.images[0].requires_grad  # lanes run under the caller's inference mode


@pytest.mark.parametrize("step", [True, False], ids=["step", "request"])
def test_a_failure_in_one_lane_fails_only_its_request(tiny_model, step):
    outs, _ = run(tiny_model, step=step, threads=2, fail_at_step=1)  # request 1 raises at its step 1
    assert [o.status for o in outs] == ["completed", "error", "completed", "completed"]
    assert "injected failure" in outs[1].error


def test_lanes_run_only_where_splitting_cannot_change_the_computation():
    class Safe:
        concurrent_calls_safe = True

    cpu = torch.device("cpu")
    plain = OmniDiffusionConfig(model="x")
    assert lanes_allowed(plain, Safe(), cpu)
    assert not lanes_allowed(plain, object(), cpu)  # a pipeline that does not declare it
    cached = SimpleNamespace(world_size=1, cache_backend="tea_cache")  # any cache backend keeps per-call state
    assert not lanes_allowed(cached, Safe(), cpu)
    assert not lanes_allowed(OmniDiffusionConfig(model="x", parallel_config={"ulysses_degree": 2}), Safe(), cpu)
    assert not lanes_allowed(plain, Safe(), torch.device("meta"))  # not the CPU


def test_sub_batches_are_contiguous_and_keep_the_order():
    lanes = CpuLanes(3, enabled=True)
    seen = []

    def fn(chunk):
        seen.append(list(chunk))
        return [x * 10 for x in chunk]

    from omni_core.worker.timing import WaveClock

    try:
        assert lanes.map(fn, list(range(7)), WaveClock()) == [x * 10 for x in range(7)]
        assert sorted(seen) == [[0, 1, 2], [3, 4], [5, 6]]
        seen.clear()
        assert lanes.map(fn, [1], WaveClock()) == [10] and seen == [[1]]  # one request: one lane, every thread
        assert torch.get_num_threads() == 3
    finally:
        lanes.shutdown()
        torch.set_num_threads(max(1, __import__("os").cpu_count() or 1))


def test_step_mode_encodes_a_waves_new_requests_across_the_lanes_and_a_failing_one_fails_alone(tiny_model):
    """A request's encoding is a cost batching does not shrink; in step mode the new requests of a wave are
    encoded one sub-batch per lane, as the request path's ``forward`` does, and an encoding that raises fails
    only its request."""
    import threading

    with Omni(tiny_model, step_execution=True, max_num_seqs=4, cpu_threads=2, warmup=False) as omni:
        pipe = omni.engine.executor.runner.pipeline
        encode, window, seen, windows = pipe.prepare_encode, pipe.encoded_prompts, [], []

        def recording(state):
            seen.append((state.request.prompt, threading.current_thread().name))
            if state.request.prompt == "p2":
                raise RuntimeError("encoder broke on p2")
            return encode(state)

        def recording_window(states):
            windows.append(([s.request.prompt for s in states], threading.current_thread().name))
            return window(states)

        pipe.prepare_encode, pipe.encoded_prompts = recording, recording_window
        outs = [h.result(timeout=120) for h in omni.engine.submit(requests(4))]
    assert [o.status for o in outs] == ["completed", "completed", "error", "completed"]
    assert "encoder broke on p2" in outs[2].error
    # one wave of four (submit queues them at once), one window per lane; which pool thread takes which
    # sub-batch is the pool's choice (one thread may take both when the other is slow to wake)
    assert sorted(prompts for prompts, _ in windows) == [["p0", "p1"], ["p2", "p3"]]
    assert all(name.startswith("omni-lane") for _, name in windows + seen) and len(seen) == 4

"""The hot path's accounting and switches: where a wave's time goes (``engine.wave_timing()``), the one CPU
thread knob (``cpu_threads``), and no preview work for a request nobody streams. Counts and structure are
asserted here; the speeds themselves are measured by ``bench/hot_path.py`` and ``bench/batching.py``."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from omni_core import Omni, SamplingParams
from omni_core.config import OmniDiffusionConfig
from omni_core.errors import ConfigError
from omni_core.request import OmniDiffusionRequest


def requests(n: int, steps: int, **kw) -> list[OmniDiffusionRequest]:
    return [OmniDiffusionRequest(prompt=f"p{i}", sampling_params=SamplingParams(seed=i, num_inference_steps=steps), **kw)
            for i in range(n)]


def run_all(omni, reqs):
    return [h.result(timeout=120) for h in omni.engine.submit(reqs)]


@pytest.mark.parametrize("executor,step", [("uni", False), ("uni", True), ("mp", False), ("mp", True)])
def test_wave_timing_counts_every_denoising_step_and_splits_the_wave(tiny_model, executor, step):
    with Omni(tiny_model, executor=executor, step_execution=step, max_num_seqs=2, warmup=False) as omni:
        outs = run_all(omni, requests(3, steps=4))  # waves of 2 + 1 requests, 4 steps each
        t = omni.engine.wave_timing()
    assert all(o.status == "completed" for o in outs)
    # one denoiser call per step of each wave: 2 waves x 4 steps (in step mode the third request joins a wave
    # of its own once the first two are done, so it is also 4 + 4)
    assert t["denoise_calls"] == 8
    assert t["waves"] == (8 if step else 2)
    assert 0 < t["denoise_s"] <= t["pipeline_s"] <= t["wave_s"]
    assert t["engine_s"] == pytest.approx(t["wave_s"] - t["pipeline_s"])
    assert t["engine_s_per_step"] == pytest.approx(t["engine_s"] / 8)
    assert omni.stats()["timing"]["denoise_calls"] == 8


def test_cpu_threads_is_set_once_for_the_model_process(tiny_model):
    before = torch.get_num_threads()
    try:
        with Omni(tiny_model, cpu_threads=1, warmup=False) as omni:
            assert torch.get_num_threads() == 1  # the uni executor's model process is this one
            seen = []
            pipe = omni.engine.executor.runner.pipeline
            denoise = pipe.denoise_step
            pipe.denoise_step = lambda states: (seen.append(torch.get_num_threads()), denoise(states))[1]
            run_all(omni, requests(2, steps=3))
            assert seen and set(seen) == {1}  # nothing changes it per call
    finally:
        torch.set_num_threads(before)


def test_thread_policy_default_divides_the_usable_cores_among_model_processes(monkeypatch):
    from omni_core.platforms.threads import thread_policy, threads_per_process, usable_cpu_cores

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # the test plugin sets it
    cores = usable_cpu_cores()
    default = OmniDiffusionConfig(model="x")
    assert threads_per_process(default) == cores
    assert threads_per_process(default, processes=cores * 2) == 1  # never zero
    assert threads_per_process(OmniDiffusionConfig(model="x", cpu_threads=3), processes=2) == 3
    assert "usable cores" in thread_policy(default) and "cpu_threads" in thread_policy(
        OmniDiffusionConfig(model="x", cpu_threads=3))
    # an explicit OMP_NUM_THREADS (a shared machine's job slot, a test run) is the default; cpu_threads still wins
    for value, want in (("3", 3), ("4,2", 4), ("0", cores), ("many", cores), ("", cores)):
        monkeypatch.setenv("OMP_NUM_THREADS", value)
        assert threads_per_process(default) == want, value
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert threads_per_process(default, processes=8) == 3 and "OMP_NUM_THREADS" in thread_policy(default)
    assert threads_per_process(OmniDiffusionConfig(model="x", cpu_threads=2)) == 2
    with pytest.raises(ConfigError, match="cpu_threads"):
        OmniDiffusionConfig(model="x", cpu_threads=0)


def test_cpu_threads_flag_reaches_the_config():
    import argparse

    from omni_core.cli.options import add_engine_options, engine_options

    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    assert engine_options(parser.parse_args(["--cpu-threads", "2"]))["cpu_threads"] == 2
    assert "cpu_threads" not in engine_options(parser.parse_args([]))


def test_no_previews_for_a_request_nobody_streams(tiny_model):
    """A streaming engine computes previews only for requests that ask for them; a request with
    ``stream_previews=False`` in the same wave gets only its final output (and its progress)."""
    with Omni(tiny_model, streaming_output=True, max_num_seqs=2, warmup=False) as omni:
        pipe = omni.engine.executor.runner.pipeline
        previewed = []
        preview = pipe.preview
        pipe.preview = lambda state: (previewed.append(state.request_id), preview(state))[1]
        streamed, quiet = requests(1, steps=3) + [OmniDiffusionRequest(
            prompt="q", sampling_params=SamplingParams(seed=9, num_inference_steps=3), stream_previews=False)]
        steps = []
        h_stream, h_quiet = omni.engine.submit([streamed, quiet],
                                               on_progress=lambda rid, step, total: steps.append((rid, step)))
        outs_stream = []
        while not outs_stream or not outs_stream[-1].finished:
            outs_stream.append(h_stream.get(timeout=60))
        final_quiet = h_quiet.get(timeout=60)
    assert [o.finished for o in outs_stream] == [False, False, False, True]
    assert final_quiet.finished and final_quiet.status == "completed" and final_quiet.images
    assert set(previewed) == {streamed.request_id} and len(previewed) == 3
    assert [s for rid, s in steps if rid == quiet.request_id] == [1, 2, 3]


def test_small_output_tensors_cross_processes_as_bytes_and_come_back_equal():
    from omni_core.outputs import DiffusionOutput
    from omni_core.waves import RunnerOutput
    from omni_core.worker.transport import BY_VALUE_MAX_BYTES, TensorBytes, pack_outputs, unpack_outputs

    small = [torch.rand(1, 3, 8, 8), torch.rand(2, 3).bfloat16(), torch.zeros(0, 3), torch.arange(6).reshape(2, 3)[:, ::2]]
    large = torch.zeros(BY_VALUE_MAX_BYTES // 4 + 1)
    outs = {f"r{i}": DiffusionOutput(request_id=f"r{i}", tensor=t, preview=t) for i, t in enumerate(small)}
    outs["big"] = DiffusionOutput(request_id="big", tensor=large)
    result = pack_outputs(RunnerOutput(outputs=outs))
    assert all(isinstance(result.outputs[f"r{i}"].tensor, TensorBytes) for i in range(len(small)))
    assert result.outputs["big"].tensor is large  # shared memory is cheaper for large tensors
    back = unpack_outputs(result)
    for i, t in enumerate(small):
        for got in (back.outputs[f"r{i}"].tensor, back.outputs[f"r{i}"].preview):
            assert got.dtype == t.dtype and torch.equal(got, t)


def test_post_processing_runs_in_the_readers_thread_and_leaves_the_models_count_alone(tiny_model):
    """A finished image's post-processing runs where the caller reads it, never on the engine's loop or the
    executor's thread (it would hold up the next denoising step of the others), on one torch thread (no OpenMP
    team of the caller's spinning on the model's cores) with the caller's own count given back, and the model's
    waves keep the policy's thread count after it."""
    import threading

    before = torch.get_num_threads()
    torch.set_num_threads(2)  # the caller's own count
    try:
        with Omni(tiny_model, cpu_threads=2, warmup=False) as omni:
            engine = omni.engine
            pipe = engine.executor.runner.pipeline
            seen_model, seen_post = [], []
            denoise = pipe.denoise_step
            pipe.denoise_step = lambda states: (seen_model.append(torch.get_num_threads()), denoise(states))[1]
            cls = engine.pipeline_cls
            post, own = cls.post_process, cls.__dict__.get("post_process")
            cls.post_process = classmethod(
                lambda c, out, req: (seen_post.append((threading.current_thread().name, torch.get_num_threads())),
                                     post(out, req))[1])
            try:
                for i in range(3):  # one request at a time: every wave after the first post-processing
                    run_all(omni, requests(1, steps=2))
            finally:
                if own is None:
                    del cls.post_process
                else:
                    cls.post_process = own
        assert seen_post == [(threading.current_thread().name, 1)] * 3
        assert torch.get_num_threads() == 2
        assert len(seen_model) == 6 and set(seen_model) == {2}
    finally:
        torch.set_num_threads(before)


def test_a_thread_that_runs_waves_gets_the_policys_count_whatever_another_thread_set():
    """torch gives a thread that has not run a parallel op yet the count set last anywhere (here: 1, as the
    delivery thread sets for itself); the runner's waves still run with the policy's."""
    import threading

    from omni_core.worker.lanes import CpuLanes
    from omni_core.worker.timing import WaveClock

    before = torch.get_num_threads()
    seen = []
    try:
        setter = threading.Thread(target=torch.set_num_threads, args=(1,))
        setter.start()
        setter.join()
        lanes = CpuLanes(2, enabled=False)  # lanes off (e.g. a cache backend): one call with every thread
        waves = threading.Thread(target=lambda: lanes.map(lambda batch: seen.append(torch.get_num_threads()) or batch,
                                                          [1, 2, 3], WaveClock()))
        waves.start()
        waves.join()
    finally:
        torch.set_num_threads(before)
    assert seen == [2]


def _os_threads() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def threads_left_by(fn, tries: int = 3) -> int:
    """OS threads that ``fn``, run on a fresh thread with two torch threads, adds while that thread lives: the
    worker of an OpenMP team, if it ran a parallel torch kernel (libgomp keeps one team per calling thread).
    New thread ids only (a thread of an earlier test ending meanwhile does not hide one), and the fewest over
    ``tries`` fresh threads (one started meanwhile elsewhere does not add one; a team opens every time)."""
    import threading

    counts = []

    def run():
        torch.set_num_threads(2)
        before = _os_threads()
        fn()
        counts.append(len(_os_threads() - before))

    before = torch.get_num_threads()
    try:
        for _ in range(tries):
            t = threading.Thread(target=run)
            t.start()
            t.join()
    finally:
        torch.set_num_threads(before)
    return min(counts)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc (Linux)")
def test_image_conversions_open_no_openmp_team_on_the_thread_that_runs_them():
    """Input images (the caller's thread), outputs and previews (the delivery and server threads) are converted
    off the model's thread; a team there would make libgomp stop spinning the model's idle threads once the
    process holds more OpenMP threads than cores (docs/runtime.md, "CPU threads and lanes")."""
    from PIL import Image

    from omni_core.images import to_pil, to_tensor
    from omni_core.pipelines import tensor_to_pil

    image = torch.rand(3, 256, 256)
    assert threads_left_by(lambda: image.mul(2)) >= 1  # the probe sees a team where a kernel runs in parallel
    half = image.to(torch.bfloat16)  # converted here: a kernel on the probed thread would count
    pil = Image.new("RGB", (256, 256), (10, 20, 30))
    assert threads_left_by(lambda: tensor_to_pil(image)) == 0
    assert threads_left_by(lambda: tensor_to_pil(half)) == 0
    assert threads_left_by(lambda: to_pil(to_tensor(pil))) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_tensor_to_pil_gives_the_pixels_of_torchs_clamp_scale_round(dtype):
    from omni_core.pipelines import tensor_to_pil

    g = torch.Generator().manual_seed(0)
    t = (torch.rand(3, 17, 23, generator=g) * 1.4 - 0.2).to(dtype)  # out-of-range values too
    t[0, 0, :5] = torch.tensor([0.5 / 255, 1.5 / 255, 2.5 / 255, 0.0, 1.0]).to(dtype)  # halves round to even
    expected = (t.float().clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    got = tensor_to_pil(t)
    assert got.mode == "RGB" and got.size == (23, 17)
    assert (np.asarray(got) == expected).all()

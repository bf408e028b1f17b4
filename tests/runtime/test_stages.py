"""The encode and decode stages in processes of their own (issue #40, ``encode_workers=1``, ``decode_workers=1``).

Outputs equal the in-line pipeline's bit for bit (shapes, a tiny Qwen-Image and a tiny Wan 2.2, request and step
mode; threads fixed at one per process so every process sums in the same order); the model process holds no
text-encoder or VAE weights and each stage process only its own (``stats()["model_bytes"]`` /
``stats()["stages"]``); a request waiting for its encode or decode is aborted at once and times out at its
deadline; priorities order the requests waiting for their encode; a killed stage process fails its requests
with an error naming the stage and the engine reports it; no stage process outlives its engine, closed or
killed; what cannot work is refused by name."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from omni_core import Omni
from omni_core.config import SamplingParams
from omni_core.errors import ConfigError

SHAPES = {"height": 16, "width": 16, "num_inference_steps": 2}
QWEN = {"height": 16, "width": 16, "num_inference_steps": 2, "max_sequence_length": 32}
MODES = [pytest.param(False, id="request"), pytest.param(True, id="step")]


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from omni_core.testing.diffusers_folders import build_tiny_qwen_image

    return build_tiny_qwen_image(tmp_path_factory.mktemp("qwen-stages"))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


BOTH = {"encode_workers": 1, "decode_workers": 1}
IN_LINE: dict = {}


_IN_LINE_RUNS: dict = {}


def in_line(model: str, step: bool, params: dict, **kwargs):
    """``run`` with every stage in line, once per module for each setting (several tests compare against it)."""
    key = (model, step, repr(params), repr(kwargs))
    if key not in _IN_LINE_RUNS:
        _IN_LINE_RUNS[key] = run(model, step, IN_LINE, params, **kwargs)
    return _IN_LINE_RUNS[key]


def run(model: str, step: bool, stages: dict, params: dict, n: int = 3, **kwargs):
    with Omni(model, warmup=False, step_execution=step, cpu_threads=1, max_num_seqs=4, **stages, **kwargs) as omni:
        outs = omni.generate(["a red circle in the top left"] * (n - 1) + ["a blue square"],
                             [SamplingParams(seed=s, **params) for s in range(n)], use_tqdm=False)
        stats = omni.engine.stats()
    for stage in stats.get("stages", {}).values():
        assert not alive(stage["pid"])  # closed with its engine
    return outs, stats


@pytest.mark.parametrize("step, stages", [pytest.param(False, BOTH, id="request-encode+decode"),
                                          pytest.param(True, BOTH, id="step-encode+decode"),
                                          pytest.param(True, {"encode_workers": 1}, id="step-encode")])
def test_shapes_outputs_equal_in_line(step, stages):
    split, stats = run("shapes", step, stages, SHAPES)
    inline, inline_stats = in_line("shapes", step, SHAPES)
    assert stats["stages"]["encode"]["done"] == 3
    assert stats["stages"]["encode"]["model_bytes"] == {"text_encoder": inline_stats["model_bytes"]["text_encoder"]}
    assert set(stats["model_bytes"]) == {"transformer"}  # the model process: no text encoder
    if "decode_workers" in stages:
        assert stats["stages"]["decode"]["done"] == 3 and stats["stages"]["decode"]["model_bytes"] == {}
    for a, b in zip(split, inline):
        assert torch.equal(a.tensor, b.tensor)
        assert a.metrics.get("decode_batch_size", 1) >= 1 and "peak_memory_mb" in a.metrics


@pytest.mark.parametrize("step", MODES)
def test_qwen_image_outputs_equal_in_line_and_the_model_process_holds_the_denoiser_only(qwen_dir, step):
    split, stats = run(qwen_dir, step, BOTH, QWEN)
    inline, inline_stats = in_line(qwen_dir, step, QWEN)
    assert inline_stats["model_bytes"]["vae"] > 0 and inline_stats["model_bytes"]["text_encoder"] > 0
    assert set(stats["model_bytes"]) == {"transformer"} and stats["model_bytes"]["transformer"] > 0
    assert stats["stages"]["decode"]["model_bytes"] == {"vae": inline_stats["model_bytes"]["vae"]}
    assert stats["stages"]["encode"]["model_bytes"] == {"text_encoder": inline_stats["model_bytes"]["text_encoder"]}
    for a, b in zip(split, inline):
        assert a.status == "completed" and torch.equal(a.tensor, b.tensor)


def wait_for(cond, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _request(seed: int, **params):
    from omni_core.request import OmniDiffusionRequest

    return OmniDiffusionRequest(prompt="a red circle in the top left",
                                sampling_params=SamplingParams(seed=seed, **SHAPES, **params))


@pytest.mark.parametrize("stage", ["decode", "encode"])
def test_a_killed_stage_process_fails_its_requests_naming_the_stage(stage):
    with Omni("shapes", warmup=False, step_execution=True, max_num_seqs=4, **{f"{stage}_workers": 1}) as omni:
        pid = omni.engine.stats()["stages"][stage]["pid"]
        os.kill(pid, signal.SIGSTOP)  # every request waits for it
        handles = omni.engine.submit([omni.engine.prepare_request(_request(s)) for s in range(2)])
        wait_for(lambda: omni.engine.stats()["stages"][stage]["waiting"] == 2)
        os.kill(pid, signal.SIGKILL)
        outs = [h.result(timeout=10) for h in handles]
        what = f"{stage} stage"
        assert all(o.status == "error" and what in o.error for o in outs), [o.error for o in outs]
        assert omni.engine.is_dead and what in omni.engine.dead_reason
        assert what in omni.engine.stats()["dead"] and what in omni.engine.stats()["stages"][stage]["dead"]


SCRIPT = """
import sys
from omni_core import Omni
if __name__ == "__main__":
    omni = Omni("shapes", warmup=False, decode_workers=1)
    print(omni.engine.stats()["stages"]["decode"]["pid"], flush=True)
    sys.stdin.read()
"""


def test_the_decode_process_dies_with_a_killed_engine_process(tmp_path):
    script = tmp_path / "engine.py"
    script.write_text(SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        pid = int(proc.stdout.readline())
        assert alive(pid)
    finally:
        proc.kill()
        proc.wait(10)
    wait_for(lambda: not alive(pid), timeout=10)


def test_what_cannot_split_is_refused_by_name():
    with pytest.raises(ConfigError, match="offload") as err:
        Omni("shapes", warmup=False, decode_workers=1, offload="model")
    assert err.value.field == "decode_workers"
    with pytest.raises(ConfigError, match="several model ranks") as err:
        Omni("shapes", warmup=False, decode_workers=1, parallel_config={"ulysses_degree": 2}, oversubscribe=True)
    assert err.value.field == "decode_workers"
    with pytest.raises(ConfigError, match="decode_workers"):
        Omni("shapes", warmup=False, decode_workers=2)
    from omni_core.config import OmniDiffusionConfig
    from omni_core.worker.stage_contract import check_stage_config

    from omni_model_shapes.pipeline import ShapesPipeline

    with pytest.raises(ConfigError, match="text-encoder weights") as err:
        check_stage_config(OmniDiffusionConfig(model="shapes", encode_workers=1, loras={"a": "a.safetensors"}),
                           ShapesPipeline, None)
    assert err.value.field == "encode_workers"
    with pytest.raises(ConfigError, match="quantize_components names a text encoder") as err:
        Omni("shapes", warmup=False, encode_workers=1, quantization="int8",
             quantize_components=("denoiser", "text_encoder"))
    assert err.value.field == "encode_workers"


def test_the_cli_flag_reaches_the_config():
    import argparse

    from omni_core.cli.options import add_engine_options, engine_options

    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    opts = engine_options(parser.parse_args(["--decode-workers", "1", "--encode-workers", "1", "--encode-device",
                                             "cpu", "--decode-device", "0"]))
    assert (opts["decode_workers"], opts["encode_workers"], opts["encode_device"], opts["decode_device"]) == (
        1, 1, "cpu", "0")
    assert not {"decode_workers", "encode_workers", "encode_device"} & set(engine_options(parser.parse_args([])))


@pytest.mark.parametrize("step", [pytest.param(True, id="step")])
def test_previews_stream_before_the_decoded_output(qwen_dir, step):
    """Streaming previews: one per step, the last step's before the final output, which carries the image the
    in-line decode gives."""
    outputs = {}
    for workers in (1, 0):
        stages = BOTH if workers else IN_LINE
        with Omni(qwen_dir, warmup=False, step_execution=step, streaming_output=True, cpu_threads=1, **stages) as omni:
            from omni_core.request import OmniDiffusionRequest

            handle, = omni.engine.submit([OmniDiffusionRequest(prompt="a red circle", sampling_params=SamplingParams(
                seed=3, **{**QWEN, "num_inference_steps": 3}))])
            outs = []
            while not outs or not outs[-1].finished:
                outs.append(handle.get(timeout=60))
            outputs[workers] = outs
    split, inline = outputs[1], outputs[0]
    assert [o.finished for o in split] == [o.finished for o in inline] == [False] * 3 + [True]
    assert all(o.preview is not None for o in split[:-1])
    assert split[-1].status == "completed" and torch.equal(split[-1].tensor, inline[-1].tensor)
    assert split[-1].metrics["decode_batch_size"] == 1


@pytest.mark.parametrize("step", [pytest.param(False, id="request-uni"), pytest.param(True, id="step-mp")])
def test_wan22_equals_in_line(tmp_path_factory, step):
    """Wan 2.2 (two experts, true CFG: a prompt and a negative prompt per request) through both stages; in step
    mode through an ``mp`` worker, so the encodings cross engine -> worker and the payload worker -> engine ->
    decode process (a video VAE)."""
    from omni_model_wan.testing import build_tiny_wan

    folder = build_tiny_wan(tmp_path_factory.mktemp("wan-stages"), two_experts=True)
    params = {"height": 16, "width": 16, "num_frames": 5, "num_inference_steps": 2, "guidance_scale": 3.0,
              "max_sequence_length": 32}
    runs = {"split": run(folder, step, BOTH, params, executor="mp" if step else "uni"),
            "in line": run(folder, step, IN_LINE, params)}  # uni: the same bits as mp, one process less
    (split, stats), (inline, inline_stats) = runs["split"], runs["in line"]
    assert set(stats["model_bytes"]) == {"transformer", "transformer_2"}
    assert stats["stages"]["decode"]["model_bytes"] == {"vae": inline_stats["model_bytes"]["vae"]}
    assert stats["stages"]["encode"]["model_bytes"] == {"text_encoder": inline_stats["model_bytes"]["text_encoder"]}
    assert all(o.tensor.shape == (1, 5, 3, 16, 16) for o in split)
    for a, b in zip(split, inline):
        assert torch.equal(a.tensor, b.tensor)


def test_input_image_models_keep_their_vae_for_the_images(tmp_path_factory):
    """Qwen-Image-Edit: the encode process runs the VL text encoder on the request's images, the model process
    keeps the VAE (it encodes the input images) and the decode process decodes; bit-equal to in line."""
    import numpy as np
    from omni_model_qwen_image.testing import build_tiny_qwen_image_edit
    from PIL import Image

    folder = build_tiny_qwen_image_edit(tmp_path_factory.mktemp("edit-stages"))
    images = [Image.fromarray(np.random.default_rng(s).integers(0, 256, (32, 32, 3), dtype=np.uint8)) for s in (0, 1)]
    runs = []
    for stages in (BOTH, IN_LINE):
        with Omni(folder, warmup=False, step_execution=True, cpu_threads=1, **stages) as omni:
            outs = omni.generate([{"prompt": "make it red", "image": [im]} for im in images], seed=3, use_tqdm=False,
                                 output_type="pt", height=32, width=32, num_inference_steps=2)
            runs.append((outs, omni.engine.stats()))
    (split, stats), (inline, inline_stats) = runs
    assert set(stats["model_bytes"]) == {"transformer", "vae"}
    assert stats["stages"]["encode"]["model_bytes"] == {"text_encoder": inline_stats["model_bytes"]["text_encoder"]}
    assert stats["stages"]["decode"]["model_bytes"] == {"vae": inline_stats["model_bytes"]["vae"]}
    for a, b in zip(split, inline):
        assert a.status == "completed" and torch.equal(a.images[0], b.images[0])


def stopped(pid: int):
    """SIGSTOP a stage process for the ``with`` block: every request that reaches it waits."""
    import contextlib

    @contextlib.contextmanager
    def block():
        os.kill(pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(pid, signal.SIGCONT)

    return block()


def test_abort_deadline_and_priorities_while_waiting_for_a_stage():
    """One engine with both stages (``max_num_seqs=1``): a request waiting for its decode, or for its encode, is
    aborted at once; one past its deadline while waiting for its encode times out; the encode process takes what
    waits by priority and sends each submit's requests back as soon as they are encoded (the urgent one,
    submitted last, runs first); the dropped ones never surface and the engine goes on."""
    started: list[str] = []

    def on_progress(request_id: str, step: int, total: int) -> None:
        if request_id not in started:
            started.append(request_id)

    with Omni("shapes", warmup=False, step_execution=True, max_num_seqs=1, **BOTH) as omni:
        engine, pids = omni.engine, {k: v["pid"] for k, v in omni.engine.stats()["stages"].items()}

        def abort_at_once(handle) -> None:
            t0 = time.monotonic()
            engine.abort(handle.request_id)
            out = handle.result(timeout=5)
            assert out.status == "aborted" and time.monotonic() - t0 < 1.0

        with stopped(pids["decode"]):
            handle, = engine.submit([engine.prepare_request(_request(0))])
            wait_for(lambda: engine.stats()["stages"]["decode"]["waiting"] == 1)
            abort_at_once(handle)
            assert engine.stats()["stages"]["decode"]["waiting"] == 0
        with stopped(pids["encode"]):
            handle, = engine.submit([engine.prepare_request(_request(0))])
            timed, = engine.submit([engine.prepare_request(_request(1, timeout=0.5))])
            wait_for(lambda: engine.stats()["stages"]["encode"]["waiting"] == 2)
            abort_at_once(handle)
            out = timed.result(timeout=5)  # its deadline passes while the encode process is stopped
            assert out.status == "error" and "timeout" in out.error.lower(), out.error
            stats = engine.stats()
            assert stats["stages"]["encode"]["waiting"] == 0 and not stats["tracked_requests"]
            assert stats["requests_timed_out"] == 1
        with stopped(pids["encode"]):
            late = engine.submit([engine.prepare_request(_request(s, priority=5)) for s in range(3)],
                                 on_progress=on_progress)
            urgent, = engine.submit([engine.prepare_request(_request(9, priority=-1))], on_progress=on_progress)
            # all four in the stopped process's pipe (not only counted by the engine), so it finds them together
            wait_for(lambda: engine.stats()["stages"]["encode"]["waiting"] == 4
                     and engine.stats()["stages"]["encode"]["unsent"] == 0)
        assert all(h.result(timeout=60).status == "completed" for h in [urgent, *late])
        assert started[0] == urgent.request_id, started
        assert engine.stats()["requests_completed"] == 4  # the aborted and timed-out ones never surfaced


def test_the_embedding_cache_lives_in_the_encode_stage():
    """16 requests, one prompt, 16 seeds: the encode stage runs its text encoder on the prompt once (and once on
    the empty negative prompt), gives the in-line images, and stats() reports its cache."""
    outs = {}
    for name, stages in (("split", {**BOTH, "encode_device": "cpu"}), ("in line", IN_LINE)):
        with Omni("shapes", warmup=False, step_execution=True, cpu_threads=1, max_num_seqs=4, **stages) as omni:
            outs[name] = omni.generate(["a red circle in the top left"] * 16,
                                       [SamplingParams(seed=s, **SHAPES) for s in range(16)], use_tqdm=False)
            stats = omni.engine.stats()
            if name == "split":
                cache = stats["embedding_cache"]
                assert cache["misses"] == 2 and cache["hits"] == 30 and cache["entries"] == 2, cache
                # encode_device places the process; /metrics reports the stages
                assert stats["stages"]["encode"]["device"] == "cpu" and stats["stages"]["decode"]["device"] == "cpu"
                from omni_core.serve.metrics import ServerMetrics

                text = ServerMetrics().render({"shapes": stats}, video_jobs={})
                assert 'omni_stage_requests_done_total{model="shapes",stage="encode"} 16' in text
                assert 'omni_stage_requests_waiting{model="shapes",stage="decode"} 0' in text
                assert 'omni_stage_model_bytes{model="shapes",stage="encode",component="text_encoder"}' in text
    for a, b in zip(outs["split"], outs["in line"]):
        assert torch.equal(a.tensor, b.tensor)


def test_bad_stage_devices_are_refused():
    """A device the platform lacks is refused naming the field and the allowed values (and the model worker and
    the other stage, loading meanwhile, are shut down), and so is a device without its stage's process."""
    from omni_core.errors import EngineDeadError

    with pytest.raises(EngineDeadError, match=r"decode_device='3'.*allowed: auto, cpu, 0\.\.0"):
        Omni("shapes", warmup=False, encode_workers=1, decode_workers=1, decode_device=3, executor="mp")
    import multiprocessing

    # the stages and the model worker load together; one failing shuts the others down
    wait_for(lambda: not [p for p in multiprocessing.active_children() if p.name.startswith("omni-")], timeout=15)
    with pytest.raises(ConfigError, match="encode_workers=1") as err:
        Omni("shapes", warmup=False, encode_device="cpu")
    assert err.value.field == "encode_device"
    with pytest.raises(ConfigError, match="'auto'.*'cpu'") as err:
        Omni("shapes", warmup=False, decode_workers=1, decode_device="gpu")
    assert err.value.field == "decode_device"


@pytest.mark.parametrize("step", MODES)
def test_the_engine_process_rebuilds_no_encoding_and_no_latent_only_the_outputs(monkeypatch, step):
    """Encodings go from the encode process to the model process, latents from the model process to the decode
    process, sealed (``omni_core.worker.transport.Sealed``): the engine's process passes them on and rebuilds
    only the finished images it delivers. Counted at every way a tensor is rebuilt from a message here: a
    shared-memory tensor (``torch.multiprocessing``), a pickled one, and the small outputs sent as bytes."""
    import torch._utils
    import torch.multiprocessing.reductions as reductions

    from omni_core.worker.transport import TensorBytes

    rebuilt: list[str] = []

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            rebuilt.append(name)
            return fn(*args, **kwargs)
        return wrapper

    requests = [_request(seed, output_type="pt") for seed in range(4)]
    with Omni("shapes", warmup=False, executor="mp", step_execution=step, max_num_seqs=4, encode_workers=1,
              decode_workers=1) as omni:
        monkeypatch.setattr(reductions, "rebuild_tensor", counting("shared", reductions.rebuild_tensor))
        monkeypatch.setattr(torch._utils, "_rebuild_tensor_v2", counting("pickled", torch._utils._rebuild_tensor_v2))
        monkeypatch.setattr(TensorBytes, "tensor", counting("bytes", TensorBytes.tensor))
        handles = omni.engine.submit([omni.engine.prepare_request(r) for r in requests])
        outs = [h.result(timeout=120) for h in handles]
        stages = omni.engine.stats()["stages"]
    assert [o.status for o in outs] == ["completed"] * 4
    assert stages["encode"]["done"] >= 4 and stages["decode"]["done"] >= 4  # both stages did the work
    # one image per request, and nothing else (each request's encodings and latents would add more)
    assert len(rebuilt) == 4, rebuilt

"""The decode stage in a process of its own (issue #40, ``decode_workers=1``).

Outputs equal the in-line decode's bit for bit (shapes and a tiny Qwen-Image, request and step mode; threads
fixed at one per process so both decodes sum in the same order); the model process holds no VAE weights and the
decode process only them (``stats()["model_bytes"]`` / ``stats()["stages"]``); a request waiting for its decode
is aborted at once; a killed decode process fails its requests with an error naming the stage and the engine
reports it; no decode process outlives its engine, closed or killed; what cannot work is refused by name."""

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


def run(model: str, step: bool, decode_workers: int, params: dict, n: int = 3):
    with Omni(model, warmup=False, step_execution=step, decode_workers=decode_workers, cpu_threads=1,
              max_num_seqs=4) as omni:
        outs = omni.generate(["a red circle in the top left"] * n, [SamplingParams(seed=s, **params) for s in range(n)],
                             use_tqdm=False)
        stats = omni.engine.stats()
        pid = stats.get("stages", {}).get("decode", {}).get("pid")
    if pid is not None:
        assert not alive(pid)  # closed with its engine
    return outs, stats


@pytest.mark.parametrize("step", MODES)
def test_shapes_outputs_equal_in_line(step):
    split, stats = run("shapes", step, 1, SHAPES)
    inline, _ = run("shapes", step, 0, SHAPES)
    assert stats["stages"]["decode"]["done"] == 3 and stats["stages"]["decode"]["model_bytes"] == {}
    for a, b in zip(split, inline):
        assert torch.equal(a.tensor, b.tensor)
        assert a.metrics["decode_batch_size"] >= 1 and "peak_memory_mb" in a.metrics


@pytest.mark.parametrize("step", MODES)
def test_qwen_image_outputs_equal_in_line_and_no_vae_in_the_model_process(qwen_dir, step):
    split, stats = run(qwen_dir, step, 1, QWEN)
    inline, inline_stats = run(qwen_dir, step, 0, QWEN)
    assert inline_stats["model_bytes"]["vae"] > 0
    assert "vae" not in stats["model_bytes"] and stats["model_bytes"]["transformer"] > 0
    assert stats["stages"]["decode"]["model_bytes"] == {"vae": inline_stats["model_bytes"]["vae"]}
    for a, b in zip(split, inline):
        assert a.status == "completed" and torch.equal(a.tensor, b.tensor)


def decode_pid(omni: Omni) -> int:
    return omni.engine.stats()["stages"]["decode"]["pid"]


def wait_for(cond, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_abort_while_waiting_for_decode_ends_at_once():
    with Omni("shapes", warmup=False, step_execution=True, decode_workers=1, max_num_seqs=4) as omni:
        pid = decode_pid(omni)
        os.kill(pid, signal.SIGSTOP)  # the decode process holds every request that reaches it
        try:
            handle, = omni.engine.submit([omni.engine.prepare_request(_request(0))])
            wait_for(lambda: omni.engine.stats()["stages"]["decode"]["waiting"] == 1)
            t0 = time.monotonic()
            omni.engine.abort(handle.request_id)
            out = handle.result(timeout=5)
            assert out.status == "aborted" and time.monotonic() - t0 < 1.0
            assert omni.engine.stats()["stages"]["decode"]["waiting"] == 0
            assert handle.request_id not in omni.engine.stats()["tracked_requests"]
        finally:
            os.kill(pid, signal.SIGCONT)
        # the dropped decode does not surface; the engine goes on
        out, = omni.generate(["a red circle in the top left"], SamplingParams(seed=1, **SHAPES), use_tqdm=False)
        assert out.status == "completed" and out.tensor is not None


def _request(seed: int):
    from omni_core.request import OmniDiffusionRequest

    return OmniDiffusionRequest(prompt="a red circle in the top left", sampling_params=SamplingParams(seed=seed,
                                                                                                   **SHAPES))


def test_a_killed_decode_process_fails_its_requests_naming_the_stage():
    with Omni("shapes", warmup=False, step_execution=True, decode_workers=1, max_num_seqs=4) as omni:
        pid = decode_pid(omni)
        os.kill(pid, signal.SIGSTOP)
        handles = omni.engine.submit([omni.engine.prepare_request(_request(s)) for s in range(2)])
        wait_for(lambda: omni.engine.stats()["stages"]["decode"]["waiting"] == 2)
        os.kill(pid, signal.SIGKILL)
        outs = [h.result(timeout=10) for h in handles]
        assert all(o.status == "error" and "decode stage" in o.error for o in outs), [o.error for o in outs]
        assert omni.engine.is_dead and "decode stage" in omni.engine.dead_reason
        assert "decode stage" in omni.engine.stats()["dead"]
        assert "decode stage" in omni.engine.stats()["stages"]["decode"]["dead"]


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
    from omni_model_wan.i2v import WanImageToVideoPipeline

    with pytest.raises(ConfigError, match="input images") as err:
        check_stage_config(OmniDiffusionConfig(model="shapes", decode_workers=1), WanImageToVideoPipeline, None)
    assert err.value.field == "decode_workers"


def test_the_cli_flag_reaches_the_config():
    import argparse

    from omni_core.cli.options import add_engine_options, engine_options

    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    assert engine_options(parser.parse_args(["--decode-workers", "1"]))["decode_workers"] == 1
    assert "decode_workers" not in engine_options(parser.parse_args([]))


@pytest.mark.parametrize("step", MODES)
def test_previews_stream_before_the_decoded_output(qwen_dir, step):
    """Streaming previews: one per step, the last step's before the final output, which carries the image the
    in-line decode gives."""
    outputs = {}
    for workers in (1, 0):
        with Omni(qwen_dir, warmup=False, step_execution=step, streaming_output=True, decode_workers=workers,
                  cpu_threads=1) as omni:
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


def test_wan_through_the_mp_executor_equals_in_line(tmp_path_factory):
    """The payload crosses from an ``mp`` worker to the engine, then to the decode process (a video VAE)."""
    from omni_model_wan.testing import build_tiny_wan

    folder = build_tiny_wan(tmp_path_factory.mktemp("wan-stages"))
    params = {"height": 16, "width": 16, "num_frames": 5, "num_inference_steps": 2, "guidance_scale": 1.0,
              "max_sequence_length": 32}
    runs = {}
    for workers in (1, 0):
        with Omni(folder, warmup=False, step_execution=True, executor="mp", decode_workers=workers, cpu_threads=1,
                  max_num_seqs=2) as omni:
            outs = omni.generate(["a red circle"] * 3, [SamplingParams(seed=s, **params) for s in range(3)],
                                 use_tqdm=False)
            runs[workers] = ([o.tensor for o in outs], omni.engine.stats())
    (split, stats), (inline, inline_stats) = runs[1], runs[0]
    assert "vae" not in stats["model_bytes"] and stats["stages"]["decode"]["model_bytes"] == {
        "vae": inline_stats["model_bytes"]["vae"]}
    assert all(t.shape == (1, 5, 3, 16, 16) for t in split)
    for a, b in zip(split, inline):
        assert torch.equal(a, b)

"""``omni serve`` for real: the console script in a subprocess, driven by the official ``openai`` client."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from omni_core.testing import sse_events

openai = pytest.importorskip("openai")

KEY = "cli-secret"


def _omni_command() -> list[str]:
    script = Path(sys.executable).parent / "omni"
    return [str(script)] if script.exists() else [sys.executable, "-m", "omni_core.cli"]


class CliServer:
    def __init__(self, *args: str, timeout: float = 120.0, env: dict[str, str] | None = None) -> None:
        extra = env or {}
        env = {k: v for k, v in os.environ.items() if not k.startswith("OMNI_") or k == "OMNI_STRICT_PLUGINS"}
        env.update(extra)
        self.proc = subprocess.Popen([*_omni_command(), "serve", *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=env)
        self.url = None
        deadline = time.monotonic() + timeout
        lines = []
        while self.url is None:
            left = deadline - time.monotonic()
            if left <= 0 or self.proc.poll() is not None:
                code, stderr = self.stop()
                raise AssertionError(f"omni serve did not start (exit {code}): {''.join(lines)}\n{stderr}")
            ready, _, _ = select.select([self.proc.stdout], [], [], min(left, 0.5))
            if ready:
                line = self.proc.stdout.readline()
                lines.append(line)
                m = re.search(r"on (http://\S+) ", line)
                if m:
                    self.url = m.group(1)

    def stop(self, sig: int = signal.SIGINT, timeout: float = 30.0) -> tuple[int, str]:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        return self.proc.returncode, self.proc.stderr.read()


@pytest.fixture
def cli_server():
    started = []

    def start(*args: str, env: dict[str, str] | None = None) -> CliServer:
        srv = CliServer(*args, env=env)
        started.append(srv)
        return srv

    yield start
    for srv in started:
        srv.stop(signal.SIGKILL)


def png(b64: str) -> np.ndarray:
    import base64
    import io

    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


def test_omni_serve_cli_with_openai_client(tiny_model, cli_server):
    srv = cli_server(tiny_model, "--port", "0", "--api-key", KEY, "--served-model-name", "tiny",
                     "--max-num-seqs", "2", "--max-waiting-requests", "4", "--log-level", "warning")
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list()] == ["tiny"]

    result = client.images.generate(model="tiny", prompt="a red circle", size="32x16", response_format="b64_json",
                                    n=2, extra_body={"seed": 9, "num_inference_steps": 3})
    assert len(result.data) == 2 and png(result.data[0].b64_json).shape == (16, 32, 3)

    # OpenAI's streaming example (partial_images=2): 2 previews spread over the 3 steps, then the image
    events = list(client.images.generate(model="tiny", prompt="a red circle", size="32x16", stream=True,
                                         partial_images=2, extra_body={"seed": 9, "num_inference_steps": 3}))
    types = [e.type for e in events]
    assert types == ["image_generation.partial_image"] * 2 + ["image_generation.completed"]
    assert [e.partial_image_index for e in events[:2]] == [0, 1]
    assert np.array_equal(png(events[-1].b64_json), png(result.data[0].b64_json))

    with pytest.raises(openai.BadRequestError) as info:
        client.images.generate(model="tiny", prompt="x", size="30x16")
    assert info.value.body["param"] == "size" and info.value.status_code == 400
    with pytest.raises(openai.NotFoundError):
        client.images.generate(model="dall-e-3", prompt="x")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{srv.url}/v1", api_key="wrong", max_retries=0).images.generate(prompt="x")

    import httpx

    metrics = httpx.get(f"{srv.url}/metrics").text
    assert 'omni_http_requests_total{method="POST",path="/v1/images/generations",status="200"} 2' in metrics
    assert 'omni_engine_requests_total{model="tiny",outcome="completed"}' in metrics
    code, stderr = srv.stop(signal.SIGTERM)
    assert code == 0, stderr
    assert "Traceback" not in stderr and "omni serve: stopped" in stderr


def test_serve_flags_reach_the_engine_and_ctrl_c_stops_it(tiny_model, cli_server):
    """One server with the switches that change what it answers: --no-auth wins over $OMNI_API_KEY,
    --no-stream-previews refuses a stream, the limit flags refuse past them naming the flag's limit, --no-warmup
    admits nothing at start; Ctrl-C stops it cleanly."""
    import httpx

    srv = cli_server(tiny_model, "--port", "0", "--no-auth", "--no-warmup", "--no-stream-previews", "--max-steps", "7",
                     "--max-pixels", "256", "--max-outputs", "2", "--log-level", "warning",
                     env={"OMNI_API_KEY": "env-secret"})
    assert _added(srv.url) == 0  # --no-warmup: the warm-up is one request
    r = httpx.get(f"{srv.url}/v1/models")
    assert r.status_code == 200  # --no-auth: the environment's key is ignored
    models = r.json()["data"]
    assert models[0]["id"] == tiny_model and models[0]["streaming_previews"] is False
    r = httpx.post(f"{srv.url}/v1/images/generations", json={"prompt": "x", "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream"
    for body, param, words in [({"num_inference_steps": 8}, "num_inference_steps", "max_steps=7"),
                               ({"size": "24x16"}, "size", "max_pixels=256"),
                               ({"n": 3}, "n", "max_outputs=2")]:
        r = httpx.post(f"{srv.url}/v1/images/generations", json={"prompt": "x", **body}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert words in r.json()["error"]["message"]
    r = httpx.post(f"{srv.url}/v1/images/generations", json={"prompt": "x", "num_inference_steps": 7, "n": 2},
                   timeout=60)
    assert r.status_code == 200 and len(r.json()["data"]) == 2
    code, stderr = srv.stop(signal.SIGINT)
    assert code == 0 and "Traceback" not in stderr, stderr


def test_serve_command_stays_import_light():
    """``omni --help`` and ``omni serve --help`` list the command without importing FastAPI, uvicorn or torch."""
    code = ("import sys, json\nfrom omni_core.cli.main import main\nfor argv in (['--help'], ['serve', '--help']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "print(json.dumps(sorted(m for m in ('fastapi', 'uvicorn', 'starlette', 'torch', 'httpx') "
            "if m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "usage: omni serve" in out and "--max-body-bytes" in out  # the serve command's own help
    assert out.strip().splitlines()[-1] == "[]"


def test_omni_serve_refuses_bad_options(tiny_model):
    proc = subprocess.run([*_omni_command(), "serve", tiny_model, "--port", "70000"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 1 and "--port 70000" in proc.stderr
    proc = subprocess.run([*_omni_command(), "serve", "no-such-model", "--port", "0"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 1 and "no-such-model" in proc.stderr


def test_openai_client_generates_an_image_against_omni_serve_shapes(cli_server):
    """The issue's acceptance test: the official client against a real ``omni serve shapes``, and the
    picture shows what the prompt asks for (read off by the demo model's geometric judge)."""
    pytest.importorskip("omni_model_shapes", reason="the shapes demo model (omni-model-shapes) is not installed")
    from omni_model_shapes.judge import judge_image

    args = ["shapes"]
    srv = cli_server(*args, "--port", "0", "--api-key", KEY, "--log-level", "warning")
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=KEY)
    result = client.images.generate(model="shapes", prompt="a red circle in the top left", size="32x32",
                                    response_format="b64_json", extra_body={"seed": 0})
    (item,) = result.data
    image = png(item.b64_json)
    assert image.shape == (32, 32, 3)
    seen = judge_image(torch.from_numpy(image.copy()).permute(2, 0, 1).float() / 255)
    assert (seen.colour, seen.shape, seen.position) == ("red", "circle", "top left")
    code, stderr = srv.stop(signal.SIGTERM)
    assert code == 0, stderr


# ------------------------------------------------------------------------------------------ auth options
def test_omni_api_key_from_the_environment_is_the_default(tiny_model, cli_server):
    import httpx

    srv = cli_server(tiny_model, "--port", "0", "--log-level", "warning", env={"OMNI_API_KEY": "env-secret"})
    assert httpx.get(f"{srv.url}/health").status_code == 200  # open
    assert _added(srv.url) == 1  # the warm-up request (without --no-warmup; /metrics is open)
    r = httpx.get(f"{srv.url}/v1/models")
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(f"{srv.url}/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(f"{srv.url}/v1/models", headers={"Authorization": "Bearer env-secret"}).status_code == 200
    code, stderr = srv.stop(signal.SIGTERM)
    assert code == 0, stderr


@pytest.mark.parametrize("args, env, words", [
    (["--api-key", ""], {}, "--api-key ''"),
    (["--api-key", "two words"], {}, "--api-key 'two words'"),
    ([], {"OMNI_API_KEY": ""}, "$OMNI_API_KEY ''"),
    (["--api-key", "k", "--no-auth"], {}, "--no-auth"),
])
def test_an_empty_or_contradictory_key_is_refused_before_loading(tiny_model, args, env, words):
    run_env = {k: v for k, v in os.environ.items() if not k.startswith("OMNI_")}
    proc = subprocess.run([*_omni_command(), "serve", tiny_model, "--port", "0", *args], capture_output=True,
                          text=True, timeout=60, env={**run_env, **env})
    assert proc.returncode == 1 and words in proc.stderr, proc.stderr
    assert "loading" not in proc.stderr  # refused before the model is loaded


def _worker_pids(pid: int) -> list[int]:
    """The model worker processes below ``pid`` (by the name Omni gives them; not the fork server or the resource
    tracker)."""
    from omni_core.testing.processes import named

    return named(pid, "omni-worker-")


def _in_flight(url: str, headers: dict, slow: dict) -> tuple[dict, "object", "object"]:
    """Start one non-streamed and one streamed slow request on threads; returns (results, threads...)."""
    import threading

    import httpx

    results: dict = {}

    def plain() -> None:
        t = time.monotonic()
        r = httpx.post(f"{url}/v1/images/generations", json=slow, headers=headers, timeout=120)
        results["plain"] = (r.status_code, r.json() if r.headers.get("content-type") == "application/json"
                            else r.text, time.monotonic() - t)

    def streamed() -> None:
        t = time.monotonic()
        with httpx.stream("POST", f"{url}/v1/images/generations", json={**slow, "stream": True, "step_previews": True},
                          headers=headers,
                          timeout=120) as s:
            results["stream"] = (s.status_code, sse_events(s), time.monotonic() - t)

    threads = [threading.Thread(target=plain), threading.Thread(target=streamed)]
    for t in threads:
        t.start()
    return results, *threads


def _wait_running(url: str, n: int, timeout: float = 60.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while httpx.get(f"{url}/health", timeout=10).json().get("running") != n:
        assert time.monotonic() < deadline, f"{n} requests never ran"
        time.sleep(0.1)


def test_engine_death_answers_503_in_flight_then_omni_serve_exits_non_zero(tiny_model, cli_server):
    """SIGKILL the worker of ``omni serve --executor mp``: both in-flight requests get the engine-dead error
    in OpenAI's shape (the stream as an error event), then the server exits with status 3 so a supervisor
    restarts it."""
    srv = cli_server(tiny_model, "--port", "0", "--executor", "mp", "--api-key", KEY, "--max-num-seqs", "2",
                     "--max-steps", "1000", "--log-level", "warning")
    headers = {"Authorization": f"Bearer {KEY}"}
    results, *threads = _in_flight(srv.url, headers, {"prompt": "slow", "num_inference_steps": 1000,
                                                       "extra_args": {"sleep_per_step": 0.05}})
    _wait_running(srv.url, 2)
    (worker,) = _worker_pids(srv.proc.pid)
    os.kill(worker, signal.SIGKILL)
    t0 = time.monotonic()
    for t in threads:
        t.join(60)
    status, body, _ = results["plain"]
    assert status == 503, body
    assert body["error"]["type"] == "engine_dead" and body["error"]["code"] == "engine_dead"
    assert body["error"]["param"] is None and body["error"]["message"].count("the engine is dead") == 1
    status, events, _ = results["stream"]
    assert status == 200 and events[-1][0] == "error", events[-3:]
    assert events[-1][1]["error"]["code"] == "engine_dead"
    try:
        code = srv.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        raise AssertionError("omni serve kept running after its engine died") from None
    assert time.monotonic() - t0 < 40
    stderr = srv.proc.stderr.read()
    assert code == 3 and "the engine died" in stderr, stderr[-2000:]


def test_sigterm_aborts_long_requests_after_the_grace_and_answers_them(tiny_model, cli_server):
    """SIGTERM with two 20-second requests in flight and --shutdown-grace 1: both are aborted through the
    engine once the grace is over; the plain one gets a JSON 503 ``request_aborted``, the stream an error
    event before it ends; the server exits 0 long before the requests would have finished."""
    srv = cli_server(tiny_model, "--port", "0", "--shutdown-grace", "1", "--max-num-seqs", "2", "--max-steps",
                     "1000", "--log-level", "warning")
    results, *threads = _in_flight(srv.url, {}, {"prompt": "slow", "num_inference_steps": 1000,
                                                 "extra_args": {"sleep_per_step": 0.02}})
    _wait_running(srv.url, 2)
    t0 = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(60)
    status, body, seconds = results["plain"]
    assert status == 503 and body["error"]["code"] == "request_aborted", body
    assert "shutting down" in body["error"]["message"]
    status, events, _ = results["stream"]
    assert status == 200 and events[-1][0] == "error" and events[-1][1]["error"]["code"] == "request_aborted"
    assert [e for e, _ in events[:-1]] == ["image_generation.partial_image"] * (len(events) - 1)
    code, stderr = srv.stop(signal.SIGTERM, timeout=30)
    assert time.monotonic() - t0 < 15  # 1 s grace, then at most a step: not the 20 s the requests wanted
    assert code == 0 and "Traceback" not in stderr, stderr[-2000:]


def _added(url: str) -> int:
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=30).text
    return int(re.search(r'^omni_engine_requests_total\{[^}]*outcome="added"\} (\d+)$', text, re.M).group(1))


def test_no_warmup_and_oversubscribe_reach_the_engine(tiny_model, cli_server, capsys):
    """--oversubscribe: a world size beyond the usable cores starts instead of being refused (and with --no-warmup
    admits nothing at start; a server without it admitted its warm-up:
    ``test_omni_api_key_from_the_environment_is_the_default``)."""
    from omni_core.cli.main import main

    world = json.dumps({"data_parallel_size": len(os.sched_getaffinity(0)) + 1})
    # refused before any worker starts (in process: no server is started)
    assert main(["serve", tiny_model, "--port", "0", "--parallel-config", world]) == 1
    err = capsys.readouterr().err
    assert "--oversubscribe" in err, err
    over = cli_server(tiny_model, "--port", "0", "--parallel-config", world, "--oversubscribe", "--no-warmup",
                      "--log-level", "warning")
    assert _added(over.url) == 0  # --no-warmup
    import httpx

    r = httpx.post(f"{over.url}/v1/images/generations", json={"prompt": "x", "num_inference_steps": 2}, timeout=120)
    assert r.status_code == 200
    code, stderr = over.stop(signal.SIGTERM)
    assert code == 0, stderr


def test_omni_serve_several_models_from_a_models_file_and_arguments(cli_server, tmp_path, capsys):
    """A models file (a pinned model, the contention policy) plus a NAME=MODEL argument and --device-budget: the
    pinned model holds the budget, so the other is refused at once (503) naming it; routing by model, 404 for
    another name; and bad several-model options are refused before any model loads."""
    import httpx

    models = tmp_path / "models.toml"
    models.write_text('[residency]\ncontention = "fail"\n\n'
                      '[[models]]\nname = "circles"\nmodel = "shapes"\npinned = true\n')
    body = {"prompt": "a red circle", "size": "64x64", "num_inference_steps": 2, "seed": 0}
    for bad, words in ((["--models-file", str(tmp_path / "none.toml")], "does not exist"),
                       (["--models-file", str(models), "--pin", "squares"], "--pin 'squares' is not a served model"),
                       (["a=shapes", "b=shapes", "--device-budget", "lots"], "device_budget='lots' is invalid")):
        from omni_core.cli.main import main

        assert main(["serve", *bad, "--port", "0"]) == 1  # in process: refused before any model loads
        err = capsys.readouterr().err
        assert words in err, err
    srv = cli_server("--models-file", str(models), "squares=shapes", "--device-budget", "20MB", "--port", "0",
                     "--no-auth", "--no-warmup")
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        listed = {m["id"]: m for m in c.get("/v1/models").json()["data"]}
        assert listed["circles"]["state"] == "device" and listed["circles"]["pinned"], listed
        assert listed["squares"]["state"] == "cold" and not listed["squares"]["pinned"], listed
        r = c.post("/v1/images/generations", json={**body, "model": "squares"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_busy", r.text
        assert "'circles'" not in r.json()["error"]["message"] and "circles" in r.json()["error"]["message"]
        assert c.post("/v1/images/generations", json={**body, "model": "circles"}).status_code == 200
        r = c.post("/v1/images/generations", json={**body, "model": "triangles"})
        assert r.status_code == 404 and "'circles', 'squares'" in r.json()["error"]["message"], r.text

"""Our commands print no import noise from optional libraries (torchao's kernel libraries that do not load here,
torch's pytree deprecations, diffusers' torchao notice): ``omni_core.utils.quiet``. Real subprocesses, real stderr."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

NOISE = ("Failed to load", "_pytree", "Unable to import `torchao`", "Traceback", "Warning:", "warnings.warn")


def _omni(*args: str, env: dict | None = None, cwd: str | None = None) -> subprocess.CompletedProcess:
    script = os.path.join(os.path.dirname(sys.executable), "omni")
    base = {k: v for k, v in os.environ.items() if not k.startswith("OMNI_")}
    return subprocess.run([script, *args], capture_output=True, text=True, timeout=600, cwd=cwd,
                          env={**base, **(env or {})})


def _noise(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if any(word in line for word in NOISE)]


@pytest.fixture(scope="module")
def torchao_installed() -> None:
    pytest.importorskip("torchao")  # without it there is no torchao noise to keep out


def test_omni_env_and_generate_print_no_library_noise(torchao_installed, tmp_path):
    env = _omni("env")
    assert env.returncode == 0, env.stderr
    assert _noise(env.stderr) == [], env.stderr
    gen = _omni("generate", "--model", "shapes", "--prompt", "a red circle", "--steps", "1", "--height", "32",
                "--width", "32", "--no-warmup", "--out", str(tmp_path / "x.png"))
    assert gen.returncode == 0, gen.stderr
    assert _noise(gen.stderr) == [], gen.stderr


def test_the_noise_is_there_when_asked_for(torchao_installed):
    """``OMNI_LIBRARY_WARNINGS=1`` keeps the libraries' own warnings (so the test above can fail)."""
    env = _omni("env", env={"OMNI_LIBRARY_WARNINGS": "1"})
    assert env.returncode == 0
    assert _noise(env.stderr), "torchao printed nothing: the quiet test above proves nothing here"


def test_omni_serve_prints_no_library_noise_and_one_line_per_start_up_stage(torchao_installed):
    """A real ``omni serve shapes --port 0``, one request, stopped with SIGINT: stderr holds the start-up stages
    (loading, warming up, ready) and the stop, and nothing from a library, no traceback."""
    import re
    import select
    import signal
    import time

    import httpx

    script = os.path.join(os.path.dirname(sys.executable), "omni")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNI_")}
    proc = subprocess.Popen([script, "serve", "shapes", "--port", "0", "--no-auth"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        url, deadline = None, time.monotonic() + 300
        while url is None and time.monotonic() < deadline and proc.poll() is None:
            if select.select([proc.stdout], [], [], 0.5)[0]:
                m = re.search(r"on (http://\S+) ", proc.stdout.readline())
                url = m.group(1) if m else None
        assert url, "omni serve did not start"
        r = httpx.post(f"{url}/v1/images/generations", json={"prompt": "a red circle", "num_inference_steps": 2},
                       timeout=120)
        assert r.status_code == 200, r.text
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    stderr = proc.stderr.read()
    assert proc.returncode == 0, stderr
    assert _noise(stderr) == [], stderr
    stages = [line.split(": ", 1)[1].split(" ")[0] for line in stderr.splitlines() if line.startswith("omni serve: ")]
    assert stages[:3] == ["loading", "model", "ready"] and stages[-1] == "stopped", stderr

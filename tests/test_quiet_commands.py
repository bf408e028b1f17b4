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

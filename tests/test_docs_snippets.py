"""The Python snippets of README.md and docs/serving.md run as written (issue #37): each one is listed here with
how it runs -- in a fresh interpreter in an empty folder, or against a real ``omni serve shapes`` (the snippet's
``127.0.0.1:8000`` pointed at the server's port) -- or why it cannot (a model that is not here). Every snippet
must be listed, so a new one is run or explained; the ones that cannot run still compile and import."""

from __future__ import annotations

import ast
import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)

#: (doc, the snippet's first line) -> "run" (fresh interpreter, empty folder), "server" (against omni serve shapes),
#: or why it cannot run here
SNIPPETS = {
    ("README.md", "from omni_core import Omni"): "run",
    ("README.md", "from PIL import Image"): "needs a Qwen-Image-Edit folder (/models/Qwen-Image-Edit) and cat.png",
    ("docs/serving.md", "import base64"): "server",
    ("docs/serving.md", 'client.images.edit(model="qwen-image-edit", image=open("cat.png", "rb"), prompt="make the '
                        'cat red", n=2,'): "continues the example above against an edit model (qwen-image-edit)",
    ("docs/serving.md", "from omni_core import AsyncOmni"): "serves on port 8000 until stopped (run_server blocks)",
    ("docs/serving.md", "from omni_core import Omni"): "run",
}


def snippets() -> list[tuple[str, str, str]]:
    found = []
    for doc in sorted({d for d, _ in SNIPPETS}):
        for code in BLOCK.findall((ROOT / doc).read_text()):
            found.append((doc, code.splitlines()[0], code))
    return found


def _python(code: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNI_") or k == "OMNI_STRICT_PLUGINS"}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env=env)


def test_every_snippet_is_listed():
    found = {(doc, first) for doc, first, _ in snippets()}
    assert found == set(SNIPPETS), f"unlisted snippets: {found - set(SNIPPETS)}; gone: {set(SNIPPETS) - found}"


@pytest.mark.parametrize(("doc", "first", "code"), snippets(), ids=lambda v: v if len(v) < 40 else v[:40])
def test_snippets_compile(doc, first, code):
    ast.parse(code, f"{doc}: {first}")


def test_snippets_that_cannot_run_here_import(tmp_path):
    """What they import exists (a renamed class breaks them although they cannot run here)."""
    for doc, first, code in snippets():
        if SNIPPETS.get((doc, first)) in ("run", "server"):
            continue
        imports = [ast.unparse(node) for node in ast.parse(code).body if isinstance(node, (ast.Import, ast.ImportFrom))]
        if imports:
            proc = _python("\n".join(imports), tmp_path)
            assert proc.returncode == 0, f"{doc}: {first}: {proc.stderr[-2000:]}"


@pytest.mark.parametrize(("doc", "first", "code"), [s for s in snippets() if SNIPPETS.get(s[:2]) == "run"],
                         ids=lambda v: v if len(v) < 40 else v[:40])
def test_runnable_snippets_run_as_written(tmp_path, doc, first, code):
    proc = _python(code, tmp_path)
    assert proc.returncode == 0, f"{doc}: {first}: {proc.stderr[-3000:]}"
    written = [p.name for p in tmp_path.iterdir()]
    for name in re.findall(r'\.save\("([^"]+)"\)', code):  # what the snippet says it writes, it wrote
        assert name in written, (name, written)


@pytest.fixture(scope="module")
def omni_serve_shapes():
    """A real ``omni serve shapes --port 0`` (no API key), stopped at the end."""
    script = os.path.join(os.path.dirname(sys.executable), "omni")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNI_")}
    proc = subprocess.Popen([script, "serve", "shapes", "--port", "0", "--no-auth"], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env)
    url, deadline = None, time.monotonic() + 300
    while url is None and time.monotonic() < deadline and proc.poll() is None:
        if select.select([proc.stdout], [], [], 0.5)[0]:
            m = re.search(r"on (http://\S+) ", proc.stdout.readline())
            url = m.group(1) if m else None
    try:
        assert url, "omni serve did not start"
        yield url
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.xdist_group("docs-server")  # one ``omni serve`` for all of them (a module fixture), on one worker
@pytest.mark.parametrize(("doc", "first", "code"), [s for s in snippets() if SNIPPETS.get(s[:2]) == "server"],
                         ids=lambda v: v if len(v) < 40 else v[:40])
def test_server_snippets_run_against_omni_serve_shapes(tmp_path, omni_serve_shapes, doc, first, code):
    assert "http://127.0.0.1:8000" in code  # the address `omni serve shapes --port 8000` prints
    check = "\nassert png_bytes[:8] == b'\\x89PNG\\r\\n\\x1a\\n', png_bytes[:8]\n" if "png_bytes" in code else "\n"
    proc = _python(code.replace("http://127.0.0.1:8000", omni_serve_shapes) + check, tmp_path)
    assert proc.returncode == 0, f"{doc}: {first}: {proc.stderr[-3000:]}"

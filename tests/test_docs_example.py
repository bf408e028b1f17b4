"""The plugin author's guide is true: its files are the example package's files, and its commands run as written.

The commands run in a throwaway virtual environment layered over this one (a ``.pth`` adds this
environment's site-packages), so installing the example never touches the project's ``.venv``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "plugins" / "authoring.md"
EXAMPLE = ROOT / "docs" / "examples" / "omni-attention-toy"
BLOCK = re.compile(r"<!-- (example-[a-z]+)(?:: ([^\n]*?))? -->\n\n?```[a-z]*\n(.*?)```", re.S)


def guide_blocks(kind: str) -> list[tuple[str, str]]:
    return [(arg, body) for k, arg, body in BLOCK.findall(GUIDE.read_text()) if k == kind]


def test_guide_shows_every_example_file_verbatim():
    shown = dict(guide_blocks("example-file"))
    files = sorted(str(p.relative_to(EXAMPLE)) for p in EXAMPLE.rglob("*")
                   if p.is_file() and p.suffix in (".py", ".toml") and "egg-info" not in str(p))
    assert sorted(shown) == files
    for rel, body in shown.items():
        assert body == (EXAMPLE / rel).read_text(), f"the guide's copy of {rel} differs from the example package"


def test_guide_has_commands_and_expected_output():
    assert len(guide_blocks("example-run")) == 1
    assert guide_blocks("example-output")[0][0] == "omni plugins list --kind attention"


@pytest.fixture
def layered_venv(tmp_path: Path) -> Path:
    """A fresh venv that sees this environment's packages, with ``pip``/``omni``/``pytest`` of its own."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    base = sysconfig.get_paths()["purelib"]  # addsitedir also runs the .pth files there (editable installs)
    Path(site, "_omni_base_env.pth").write_text(f"import site; site.addsitedir({base!r})\n")
    for name, module in (("pip", "pip"), ("omni", "omni_core.cli"), ("pytest", "pytest")):
        script = venv / "bin" / name
        script.write_text(f'#!/bin/sh\nexec "{python}" -m {module} "$@"\n')
        script.chmod(0o755)
    return venv


@pytest.mark.slow
def test_guide_commands_run_as_written(tmp_path: Path, layered_venv: Path):
    work = tmp_path / "omni-attention-toy"
    shutil.copytree(EXAMPLE, work, ignore=shutil.ignore_patterns("*.egg-info", "build", "__pycache__"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMNI_", "PYTHON", "PYTEST_"))}
    env.update(VIRTUAL_ENV=str(layered_venv), PATH=f"{layered_venv / 'bin'}{os.pathsep}{env.get('PATH', '')}")
    (script,) = [body for _, body in guide_blocks("example-run")]
    outputs = {}
    for command in [line for line in script.splitlines() if line.strip() and not line.startswith("#")]:
        proc = subprocess.run(["bash", "-c", command], cwd=work, env=env, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, f"`{command}` failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        outputs[command] = proc.stdout
    assert "passed" in outputs["pytest -q tests"] and "failed" not in outputs["pytest -q tests"]
    (cmd, expected), = guide_blocks("example-output")
    actual = [line.split() for line in outputs[cmd].splitlines()]
    for line in expected.splitlines():
        assert line.split() in actual, f"`{cmd}` did not print {line!r}; it printed:\n{outputs[cmd]}"
    # the project's environment was not touched
    assert "attention-toy" not in subprocess.run([sys.executable, "-m", "omni_core.cli", "plugins", "list"],
                                                 capture_output=True, text=True).stdout

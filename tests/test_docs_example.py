"""The plugin guides are true: each guide's files are its example package's files, and its commands run as written.

Guides and packages: ``authoring.md`` (attention backend ``omni-attention-toy``), ``models.md`` (model
``omni-model-toy``), ``caches.md`` (cache backend ``omni-cache-toy``), ``executors.md`` (executor
``omni-executor-toy``).

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
#: guide -> (example package folder, the command whose output the guide shows, the plugin's entry-point name)
GUIDES = {
    "authoring.md": ("omni-attention-toy", "omni plugins list --kind attention", "attention-toy"),
    "models.md": ("omni-model-toy", "omni plugins list --kind pipeline", "model-toy"),
    "caches.md": ("omni-cache-toy", "omni plugins list --kind cache", "cache-toy"),
    "executors.md": ("omni-executor-toy", "omni plugins list --kind executor", "executor-toy"),
}
BLOCK = re.compile(r"<!-- (example-[a-z]+)(?:: ([^\n]*?))? -->\n\n?```[a-z]*\n(.*?)```", re.S)


def guide_blocks(guide: str, kind: str) -> list[tuple[str, str]]:
    text = (ROOT / "docs" / "plugins" / guide).read_text()
    return [(arg, body) for k, arg, body in BLOCK.findall(text) if k == kind]


def example_dir(guide: str) -> Path:
    return ROOT / "docs" / "examples" / GUIDES[guide][0]


@pytest.mark.parametrize("guide", GUIDES)
def test_guide_shows_every_example_file_verbatim(guide):
    example = example_dir(guide)
    shown = dict(guide_blocks(guide, "example-file"))
    files = sorted(str(p.relative_to(example)) for p in example.rglob("*")
                   if p.is_file() and p.suffix in (".py", ".toml") and "egg-info" not in str(p))
    assert sorted(shown) == files
    for rel, body in shown.items():
        assert body == (example / rel).read_text(), f"{guide}'s copy of {rel} differs from the example package"


@pytest.mark.parametrize("guide", GUIDES)
def test_guide_has_commands_and_expected_output(guide):
    assert len(guide_blocks(guide, "example-run")) == 1
    assert guide_blocks(guide, "example-output")[0][0] == GUIDES[guide][1]


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


@pytest.mark.parametrize("guide", GUIDES)  # ~2 minutes in all, but the guides are what plugin authors follow: CI
def test_guide_commands_run_as_written(guide, tmp_path: Path, layered_venv: Path):
    work = tmp_path / GUIDES[guide][0]
    shutil.copytree(example_dir(guide), work, ignore=shutil.ignore_patterns("*.egg-info", "build", "__pycache__"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMNI_", "PYTHON", "PYTEST_"))}
    env.update(VIRTUAL_ENV=str(layered_venv), PATH=f"{layered_venv / 'bin'}{os.pathsep}{env.get('PATH', '')}")
    (script,) = [body for _, body in guide_blocks(guide, "example-run")]
    outputs = {}
    # in CI the example's own tests just ran against its wheel installed alone (scripts/check_dists.py runs every
    # docs/examples package): the rest of the guide still runs here, as written
    tests_done = os.environ.get("OMNI_PLUGIN_TESTS_DONE") == "1"
    for command in [line for line in script.splitlines() if line.strip() and not line.startswith("#")]:
        if tests_done and command.startswith("pytest"):
            outputs[command] = "passed (scripts/check_dists.py ran them against the example installed alone)"
            continue
        proc = subprocess.run(["bash", "-c", command], cwd=work, env=env, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, f"`{command}` failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        outputs[command] = proc.stdout
    assert "passed" in outputs["pytest -q tests"] and "failed" not in outputs["pytest -q tests"]
    (cmd, expected), = guide_blocks(guide, "example-output")
    actual = [line.split() for line in outputs[cmd].splitlines()]
    for line in expected.splitlines():
        assert line.split() in actual, f"`{cmd}` did not print {line!r}; it printed:\n{outputs[cmd]}"
    # the project's environment was not touched
    assert GUIDES[guide][2] not in subprocess.run([sys.executable, "-m", "omni_core.cli", "plugins", "list"],
                                                 capture_output=True, text=True).stdout

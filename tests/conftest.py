"""Fixtures of the core test suite.

``dummy_site`` installs the throwaway distributions under ``tests/fixtures/dists`` with a real installer (uv
where the environment has it, else pip) into a temp folder (once per session); ``dummy_plugins`` puts that folder
on ``sys.path`` for one test, so
``importlib.metadata`` discovers their entry points exactly as it discovers installed plugins.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"
DUMMY_DISTS = ("omni-dummy-good", "omni-dummy-broken", "omni-dummy-conflict")


def install_into(site: Path, sources: list[str]) -> subprocess.CompletedProcess:
    """Install the distributions at ``sources`` into the folder ``site`` (no dependencies, no index): with this
    environment's uv when it has one (scripts/install.sh installs it: ~0.8 s a distribution where pip takes ~2 s,
    paid once per test worker), else with pip (a distribution's venv in scripts/check_dists.py)."""
    uv = Path(sys.executable).parent / "uv"
    if uv.exists():
        cmd = [str(uv), "pip", "install", "-q", "--python", sys.executable, "--no-deps", "--no-build-isolation",
               "--offline", "--target", str(site), *sources]
    else:
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
               "--target", str(site), *sources]
    return subprocess.run(cmd, capture_output=True, text=True)


@pytest.fixture(scope="session")
def dummy_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding the three dummy distributions, really installed (metadata, entry points and all)."""
    root = tmp_path_factory.mktemp("dummy-dists")
    sources = []
    for name in DUMMY_DISTS:  # build from copies: a build leaves build/ and *.egg-info next to the sources
        shutil.copytree(FIXTURES / "dists" / name, root / "src" / name)
        sources.append(str(root / "src" / name))
    site = root / "site"
    proc = install_into(site, sources)
    assert proc.returncode == 0, f"installing the dummy distributions failed:\n{proc.stdout}\n{proc.stderr}"
    return site


@pytest.fixture
def dummy_plugins(dummy_site: Path, monkeypatch: pytest.MonkeyPatch):
    """The dummy distributions are installed for this test (on ``sys.path``), and gone afterwards."""
    monkeypatch.syspath_prepend(str(dummy_site))
    monkeypatch.delenv("OMNI_STRICT_PLUGINS", raising=False)
    for var in ("OMNI_PLUGINS", "OMNI_DISABLE_PLUGINS", "OMNI_NO_PLUGINS", "OMNI_PLATFORM", "OMNI_DUMMY_PLATFORM"):
        monkeypatch.delenv(var, raising=False)
    yield dummy_site
    for mod in [m for m in sys.modules if m.startswith("omni_dummy_")]:
        del sys.modules[mod]


@pytest.fixture
def use_manager(monkeypatch: pytest.MonkeyPatch):
    """``use_manager(pm)`` installs ``pm`` as the process-wide manager for this test."""
    from omni_core.platforms import reset_current_platform
    from omni_core.plugins.manager import set_plugin_manager

    previous = []

    def use(pm):
        previous.append(set_plugin_manager(pm))
        reset_current_platform()
        return pm

    yield use
    if previous:
        set_plugin_manager(previous[0])
        reset_current_platform()


def _omni_env(extra: dict[str, str] | None = None, *, site: Path | None = None) -> dict[str, str]:
    """Environment for a subprocess: no inherited OMNI_* switches, optionally the dummy site on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNI_")}
    if site is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH", "")]))
    env.update(extra or {})
    return env


def _run_omni(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run the installed ``omni`` console script (the real entry point)."""
    script = Path(sys.executable).parent / "omni"
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "omni_core.cli"]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, env=env or _omni_env(), timeout=120)


@pytest.fixture
def omni_env():
    """``omni_env(extra, site=...)``: a subprocess environment without inherited ``OMNI_*`` switches."""
    return _omni_env


@pytest.fixture
def run_omni():
    """``run_omni(*args, env=...)``: run the installed ``omni`` console script in a subprocess."""
    return _run_omni


@pytest.fixture(scope="session")
def test_pipeline_site(tmp_path_factory: pytest.TempPathFactory):
    """``omni-test-pipeline`` installed (``install_into``) into a temp folder on ``sys.path`` and ``PYTHONPATH``, so the
    engine, spawned workers (which inherit ``sys.path``) and ``omni`` subprocesses all find it through its entry
    point, like any installed plugin."""
    root = tmp_path_factory.mktemp("test-pipeline-site")
    shutil.copytree(FIXTURES / "dists" / "omni-test-pipeline", root / "src",
                    ignore=shutil.ignore_patterns("build", "*.egg-info"))
    site = root / "site"
    proc = install_into(site, [str(root / "src")])
    assert proc.returncode == 0, f"installing omni-test-pipeline failed:\n{proc.stdout}\n{proc.stderr}"
    sys.path.insert(0, str(site))
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), old) if p)
    import importlib

    importlib.invalidate_caches()
    from omni_core.plugins import reset_plugin_manager

    reset_plugin_manager()
    yield site
    sys.path.remove(str(site))
    if old is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = old
    reset_plugin_manager()


@pytest.fixture(scope="session")
def tiny_model(test_pipeline_site, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A saved model folder of the test-only ``TinyTestPipeline`` (random weights, seed 0)."""
    from omni_test_pipeline.pipeline import TinyTestPipeline

    path = tmp_path_factory.mktemp("tiny-model")
    TinyTestPipeline.save(str(path))
    return str(path)


@pytest.fixture(scope="session")
def edit_model(test_pipeline_site, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A saved model folder of the test-only ``TinyEditTestPipeline`` (an edit model: takes input images)."""
    from omni_test_pipeline.pipeline import TinyEditTestPipeline

    path = tmp_path_factory.mktemp("tiny-edit")
    TinyEditTestPipeline.save(str(path))
    return str(path)

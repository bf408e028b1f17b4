"""Runtime test fixtures: the test-only pipeline plugin, installed for real, and a tiny model folder."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

FIXTURE = Path(__file__).parent.parent / "fixtures" / "dists" / "omni-test-pipeline"


@pytest.fixture(scope="session")
def test_pipeline_plugin(tmp_path_factory):
    """Install ``omni-test-pipeline`` into a temp target so entry-point discovery (also in spawned workers,
    which inherit ``sys.path``) finds it exactly as it finds any installed plugin."""
    target = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(FIXTURE)], check=True)
    sys.path.insert(0, str(target))
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(target), old) if p)
    import importlib

    importlib.invalidate_caches()
    from omni_core.plugins import reset_plugin_manager

    reset_plugin_manager()
    yield target
    sys.path.remove(str(target))
    if old is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = old
    reset_plugin_manager()


@pytest.fixture(scope="session")
def tiny_model(test_pipeline_plugin, tmp_path_factory) -> str:
    from omni_test_pipeline.pipeline import TinyTestPipeline

    path = tmp_path_factory.mktemp("tiny-model")
    TinyTestPipeline.save(str(path))
    return str(path)

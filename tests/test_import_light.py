"""Importing the core, the CLI and the pytest plugin must not import torch (or diffusers/transformers/numpy).

Run in fresh interpreters, since this test process has long imported torch.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "diffusers", "transformers", "numpy", "cache_dit")


def imported_after(code: str, env=None) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys, json; print(json.dumps(sorted(sys.modules)))"],
                         capture_output=True, text=True, check=True, env=env)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_issue_one_liner():
    subprocess.run([sys.executable, "-c", "import omni_core, sys; assert 'torch' not in sys.modules"], check=True)


@pytest.mark.parametrize("code", [
    "import omni_core",
    "import omni_core; omni_core.OmniDiffusionConfig; omni_core.get_plugin_manager",
    "from omni_core.plugins import get_plugin_manager; get_plugin_manager().components('attention')",
    "from omni_core.config import OmniDiffusionConfig; OmniDiffusionConfig(model='m')",
    "import omni_core.testing",
    "from omni_core.attention import AttentionBackend; from omni_core.cache import CacheBackend",
    "from omni_core.cli.main import main; main(['--help'])",
    "from omni_core.cli.main import main; main(['plugins', 'list', '--all'])",
])
def test_no_heavy_imports(code, omni_env):
    if "--help" in code:
        code = f"try:\n    {code}\nexcept SystemExit:\n    pass"
    heavy = imported_after(code, env=omni_env()) & set(HEAVY)
    assert not heavy, f"{code!r} imported {sorted(heavy)}"


def test_import_omni_core_loads_only_pluggy():
    """``import omni_core`` loads hookspecs only; the manager (importlib.metadata) and attrs wait for first use."""
    mods = imported_after("import omni_core")
    ours = {m for m in mods if m.startswith("omni_core")}
    assert ours == {"omni_core", "omni_core.plugins", "omni_core.plugins.hookspecs"}
    assert "pluggy" in mods


def test_the_engine_client_interface_does_not_load_the_engine():
    """The server's one engine import is the client module; it must not drag in the engine, loader and runner."""
    mods = imported_after("import omni_core.engine.client")
    assert "omni_core.engine.engine" not in mods and "omni_core.worker.runner" not in mods and "torch" not in mods


def test_config_imports_no_plugin_and_checks_plugin_options_from_records(omni_env):
    """``import omni_core.config`` loads no plugin; checking a cache backend's and an executor's options reads their
    records (entry-point modules and their light option modules) and imports no implementation, torch or Ray."""
    plugins = ("omni_cache_", "omni_executor_", "omni_model_", "omni_attention_")
    mods = imported_after("import omni_core.config", env=omni_env())
    assert not {m for m in mods if m.startswith(plugins)} and not mods & set(HEAVY)
    for plugin in ("omni_cache_teacache", "omni_executor_ray"):  # the core alone (check_dists) has neither
        if importlib.util.find_spec(plugin) is None:
            pytest.skip(f"checking their options needs the {plugin} plugin installed")
    mods = imported_after("from omni_core.config import OmniDiffusionConfig as C; C(model='m', cache_backend="
                          "'tea_cache', cache_config={'rel_l1_thresh': 0.1}, executor='ray', executor_options="
                          "{'address': 'auto'})", env=omni_env())
    assert not mods & {*HEAVY, "ray"}
    implementations = {"omni_cache_teacache.backend", "omni_cache_dit.backend", "omni_executor_ray.executor"}
    assert not mods & implementations, sorted(mods & implementations)
    assert {"omni_cache_teacache.config", "omni_executor_ray.options"} <= mods

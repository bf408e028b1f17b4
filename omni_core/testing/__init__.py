"""pytest plugin for Omni and its plugin authors (loaded in every pytest run through the ``pytest11`` entry point).

Fixtures:

* ``omni_plugin_manager`` -- a fresh, **strict** plugin manager (built-ins plus every installed entry point),
  installed as the process-wide manager for the test and removed afterwards. ``OMNI_STRICT_PLUGINS=1`` is set
  for the test (and the processes it starts), so a plugin that fails to load fails the test.
* ``register_omni_plugin`` -- ``register_omni_plugin(obj, name, dist=...)`` registers a module or object with
  hookimpls into that manager for one test and unregisters it afterwards.

Contract tests: subclass :class:`AttentionBackendContract` and set ``backend_name``.

Markers: ``gpu`` tests are skipped when torch sees no accelerator. This module imports no torch; fixtures
and contract tests import it when they run.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import pytest

from omni_core.testing.attention import AttentionBackendContract, reference_attention

__all__ = ["AttentionBackendContract", "reference_attention"]

_MARKERS = (
    "gpu: needs a real accelerator (skipped when none is present)",
    "slow: takes more than a few seconds",
    "dist: starts several processes over torch.distributed (gloo on CPU)",
)


def pytest_configure(config: pytest.Config) -> None:
    # registered here too, so plugin packages outside this repository can use the markers without config
    for line in _MARKERS:
        config.addinivalue_line("markers", line)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return  # do not import torch for suites without gpu tests
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an accelerator; torch.cuda.is_available() is False")
    for item in gpu_items:
        item.add_marker(skip)


def pytest_report_header(config: pytest.Config) -> str:
    import importlib.metadata as md

    from omni_core.plugins.manager import ENTRY_POINT_GROUP

    eps = sorted(f"{ep.name}" for ep in md.entry_points(group=ENTRY_POINT_GROUP))
    return f"omni plugins (entry points): {', '.join(eps) or '(none)'}"


@pytest.fixture
def omni_plugin_manager(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A fresh strict ``OmniPluginManager``, installed as the process-wide manager for one test."""
    from omni_core.platforms import reset_current_platform
    from omni_core.plugins.manager import create_plugin_manager, set_plugin_manager

    monkeypatch.setenv("OMNI_STRICT_PLUGINS", "1")
    pm = create_plugin_manager(strict=True)
    previous = set_plugin_manager(pm)
    reset_current_platform()
    try:
        yield pm
    finally:
        set_plugin_manager(previous)
        reset_current_platform()


@pytest.fixture
def register_omni_plugin(omni_plugin_manager: Any) -> Iterator[Callable[..., Any]]:
    """``register_omni_plugin(plugin, name=None, *, dist=None, version="0")``: register for this test only.

    ``plugin`` is a module, class or instance with ``@omni_core.hookimpl`` functions. It is recorded like an
    installed plugin (``dist`` defaults to ``name``), so listings and error messages name it.
    """
    names: list[str] = []

    def register(plugin: Any, name: str | None = None, *, dist: str | None = None, version: str = "0") -> Any:
        name = name or getattr(plugin, "__name__", None) or type(plugin).__name__
        omni_plugin_manager.register_plugin(plugin, name, dist=dist or name, version=version)
        names.append(name)
        return plugin

    yield register
    for name in reversed(names):
        if omni_plugin_manager.has_plugin(name):
            omni_plugin_manager.unregister(name=name)

"""pytest plugin for Omni and its plugin authors (loaded in every pytest run through the ``pytest11`` entry point).

Fixtures:

* ``omni_plugin_manager`` -- a fresh, **strict** plugin manager (built-ins plus every installed entry point),
  installed as the process-wide manager for the test and removed afterwards. ``OMNI_STRICT_PLUGINS=1`` is set
  for the test (and the processes it starts), so a plugin that fails to load fails the test.
* ``register_omni_plugin`` -- ``register_omni_plugin(obj, name, dist=...)`` registers a module or object with
  hookimpls into that manager for one test and unregisters it afterwards.

* ``tiny_dit_model`` (session) -- the folder of a random-weight tiny DiT (:mod:`omni_core.testing.tiny_dit`),
  with its pipeline installed for the session as an entry point (component ``"OmniTinyDiTPipeline"``, model
  name ``"tiny-dit"``), so ``Omni(tiny_dit_model, cache_backend=...)`` works with only the core and one cache
  plugin installed (spawned workers and ``omni`` subprocesses find it too).

* ``tiny_dit`` (session) -- that tiny DiT's pipeline, loaded once through the real loader (CPU, float32), for
  tests that drive it directly; a test that enables a cache backend on it disables it after (``enable_cache``).

* ``enable_cache`` -- ``enable_cache(name, pipeline, **config)``: the cache backend registered as ``name``, built
  from ``config`` and enabled on ``pipeline``; every backend it enabled is disabled after the test (so a test never
  imports the cache plugin, and a failed test leaves the shared pipeline uncached).

* ``one_torch_thread`` -- torch at ``OMNI_TEST_THREADS`` threads (default 1) for one test, restored after: tiny
  models' kernels are microseconds long, and on a shared machine a second spinning thread costs several times
  over. A plugin's ``conftest.py`` makes it autouse with
  ``@pytest.fixture(autouse=True)`` / ``def _threads(one_torch_thread): pass``.

Contract tests: subclass :class:`AttentionBackendContract` and set ``backend_name``;
:class:`DiffusersParityContract` (a model plugin against diffusers' own pipeline, :mod:`.parity`),
:class:`PipelineContract` (a model plugin in the engine, :mod:`.pipeline_contract`) and
:class:`~omni_core.testing.cache_contract.CacheBackendContract` (cache plugins) and :class:`PlatformContract`
(platform plugins: detection, resolution, the error when absent).

Helpers: :func:`load_model` (a pipeline through the real resolver and loader, CPU float32),
:func:`load_reference` (diffusers' own pipeline from a folder), :func:`make_state` (a ``StepState``; with
``model_path=`` and ``images=``), :func:`make_states` (one per prompt), :func:`run_step_batch`,
:func:`run_request_batch`, :func:`output_tensors`, :func:`enabled_cache_backend`; :func:`wait_for`,
:func:`abort_after_steps` and :func:`sse_events` for suites that drive a running engine or server.

Markers: ``gpu`` tests are skipped when torch sees no accelerator. This module imports no torch; fixtures
and contract tests import it when they run.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, Iterator

import pytest

from omni_core.testing.attention import AttentionBackendContract, reference_attention
from omni_core.testing.driver import (enabled_cache_backend, make_state, make_states, output_tensors,
                                     outputs_and_rows, psnr, run_request_batch, run_step_batch)
from omni_core.utils.lazy import lazy_dir, lazy_exports

__all__ = ["AttentionBackendContract", "DiffusersParityContract", "PipelineContract", "enabled_cache_backend",
           "levels_apart", "load_model", "load_reference", "make_state", "make_states", "output_tensors",
           "outputs_and_rows", "psnr",
           "reference_attention", "run_request_batch", "run_step_batch", "tiny_model_fixtures", "wait_for",
           "abort_after_steps", "sse_events", "PlatformContract"]

#: exported on first use (:mod:`omni_core.utils.lazy`): only contract suites need them
_LAZY = {"DiffusersParityContract": "omni_core.testing.parity:DiffusersParityContract",
         "levels_apart": "omni_core.testing.parity:levels_apart",
         "load_reference": "omni_core.testing.parity:load_reference",
         "tiny_model_fixtures": "omni_core.testing.parity:tiny_model_fixtures",
         "PipelineContract": "omni_core.testing.pipeline_contract:PipelineContract",
         "load_model": "omni_core.testing._model:load_model",
         "wait_for": "omni_core.testing.waiting:wait_for",
         "abort_after_steps": "omni_core.testing.waiting:abort_after_steps",
         "sse_events": "omni_core.testing.waiting:sse_events",
         "PlatformContract": "omni_core.testing.platform_contract:PlatformContract"}
__getattr__ = lazy_exports(__name__, _LAZY)
__dir__ = lazy_dir(__name__, _LAZY)

_MARKERS = (
    "gpu: needs a real accelerator (skipped when none is present)",
    "slow: takes more than a few seconds",
    "dist: starts several processes over torch.distributed (gloo on CPU)",
)


def pytest_configure(config: pytest.Config) -> None:
    # registered here too, so plugin packages outside this repository can use the markers without config
    for line in _MARKERS:
        config.addinivalue_line("markers", line)
    _one_thread_per_process()


def _one_thread_per_process() -> None:
    """torch at ``OMNI_TEST_THREADS`` threads (default 1) in the test process and in the processes its tests start
    (``OMP_NUM_THREADS``, unless set): tests run beside others (``pytest -n``, ``check_dists``' jobs), and an OpenMP
    team of two on a busy 2-core machine spins -- the shapes evaluator's check took 55-58 s at two threads against
    14-16 s at one, beside a test run. An engine's own ``cpu_threads`` still sets its processes' count."""
    threads = os.environ.get("OMNI_TEST_THREADS", "1")
    os.environ.setdefault("OMP_NUM_THREADS", threads)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(int(threads))


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Every test starts at the test thread count: an engine run in the test process (the ``uni`` executor, a
    contract's in-process engine) sets torch's count by its own ``cpu_threads`` policy, and that setting would
    outlive it, leaving each later test on a spinning team (the shapes suite: 360 s against 47 s at load 7)."""
    _one_thread_per_process()


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
def one_torch_thread() -> Iterator[int]:
    """torch at ``OMNI_TEST_THREADS`` threads (default 1) for the test; the previous count restored after."""
    import torch

    before = torch.get_num_threads()
    threads = int(os.environ.get("OMNI_TEST_THREADS", "1"))
    torch.set_num_threads(threads)
    yield threads
    torch.set_num_threads(before)


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


@pytest.fixture(scope="session")
def tiny_dit(tiny_dit_model: str) -> Any:
    """The tiny DiT's pipeline, loaded once per session (see the module docstring)."""
    from omni_core.testing._model import load_model

    return load_model(tiny_dit_model)


@pytest.fixture
def enable_cache() -> Iterator[Callable[..., Any]]:
    """``enable_cache(name, pipeline, **config)`` -> an enabled cache backend, disabled after the test."""
    import contextlib

    with contextlib.ExitStack() as stack:
        yield lambda name, pipeline, **config: stack.enter_context(enabled_cache_backend(name, pipeline, **config))


@pytest.fixture(scope="session")
def tiny_dit_model(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A tiny DiT model folder (built once per session), its pipeline registered for the session.

    The registration is a real entry point: a ``.dist-info`` folder naming
    :mod:`omni_core.testing.tiny_dit_plugin`, put on ``sys.path`` and ``PYTHONPATH``, so it survives plugin
    managers being recreated and reaches worker processes, like an installed plugin.
    """
    import importlib

    from omni_core.plugins import reset_plugin_manager
    from omni_core.plugins.manager import ENTRY_POINT_GROUP
    from omni_core.testing.tiny_dit import build_tiny_dit
    from omni_core.testing.tiny_dit_plugin import DIST_NAME, ENTRY_POINT

    path = str(tmp_path_factory.mktemp("tiny-dit") / "model")
    site = tmp_path_factory.mktemp("tiny-dit-site")
    info = site / f"{DIST_NAME.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {DIST_NAME}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n{ENTRY_POINT} = omni_core.testing.tiny_dit_plugin\n")
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", "OMNI_TINY_DIT_PATH")}
    sys.path.insert(0, str(site))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), saved["PYTHONPATH"]) if p)
    os.environ["OMNI_TINY_DIT_PATH"] = path
    importlib.invalidate_caches()
    reset_plugin_manager()
    try:
        # built once registered: where no attention plugin is installed, the entry point provides a portable kernel
        build_tiny_dit(path)
        yield path
    finally:
        sys.path.remove(str(site))
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        importlib.invalidate_caches()
        reset_plugin_manager()

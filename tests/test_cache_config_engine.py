"""A cache backend's ``cache_config`` is checked in the engine's process (``CacheBackend.check_config``), so a bad
key or value is a ``ConfigError`` naming it before any worker starts -- with the ``mp`` executor too, where a
worker would otherwise take seconds to start and fail far from the caller."""

from __future__ import annotations

import multiprocessing
import multiprocessing.process
import time

import pytest

from omni_core.errors import ConfigError


@pytest.fixture
def started_processes(monkeypatch):
    """Every ``multiprocessing`` process started during the test (the real ``start`` still runs)."""
    started = []
    real_start = multiprocessing.process.BaseProcess.start

    def start(self):
        started.append(self.name)
        return real_start(self)

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", start)
    return started


@pytest.mark.parametrize("backend, config, field, allowed", [
    ("tea_cache", {"bogus": 1}, "cache_config.bogus", ("rel_l1_thresh", "coefficients", "warmup_steps")),
    ("tea_cache", {"rel_l1_thresh": -1}, "cache_config.rel_l1_thresh", ("number >= 0",)),
    ("cache_dit", {"bogus": 1}, "cache_config.bogus", ()),
])
def test_bad_cache_config_fails_in_the_engine_before_a_worker_starts(tiny_dit_model, started_processes, backend,
                                                                      config, field, allowed):
    from omni_core import Omni

    before = set(multiprocessing.active_children())
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as err:
        Omni(tiny_dit_model, executor="mp", warmup=False, cache_backend=backend, cache_config=config)
    elapsed = time.monotonic() - t0
    assert err.value.field == field
    assert field.split(".", 1)[1] in str(err.value)
    assert all(word in str(err.value) for word in allowed), str(err.value)
    assert started_processes == [], f"a process was started before the config error: {started_processes}"
    assert set(multiprocessing.active_children()) == before
    assert elapsed < 30, elapsed  # no worker start-up (spawn + torch import) was waited for


def test_good_cache_config_still_reaches_the_mp_workers(tiny_dit_model, started_processes):
    """The same path with a valid config starts the workers and generates with the cache (the check lets it by)."""
    from omni_core import Omni

    with Omni(tiny_dit_model, executor="mp", warmup=False, cache_backend="tea_cache",
              cache_config={"rel_l1_thresh": 0}) as omni:
        (out,) = omni.generate("a red square", num_inference_steps=4, use_tqdm=False, output_type="pt")
    assert started_processes, "the mp executor should have started a worker"
    assert out.metrics["cache_backend"] == "tea_cache" and out.metrics["steps_reused"] == 0


def test_the_engine_process_checks_a_cache_config_once(monkeypatch):
    """The config build checks ``cache_config`` against the backend's declared options; planning the engine does
    not check it again (``plan_engine``'s ``check_cache_config`` asks only backends that declare none or check
    more). Counted on the real validator."""
    pytest.importorskip("omni_cache_teacache")
    import omni_core.options as options
    from omni_core.config import OmniDiffusionConfig
    from omni_core.engine.plan import check_cache_config
    from omni_core.plugins.manager import get_plugin_manager

    calls = []
    real = options.validate_options

    def counted(values, opts, **kwargs):
        if kwargs.get("prefix") == "cache_config.":
            calls.append(dict(values or {}))
        return real(values, opts, **kwargs)

    import omni_core.config.plugin_options as plugin_options

    monkeypatch.setattr(options, "validate_options", counted)  # what CacheBackend.check_config imports
    monkeypatch.setattr(plugin_options, "validate_options", counted)  # what the config build calls
    cfg = OmniDiffusionConfig(model="shapes", cache_backend="tea_cache", cache_config={"rel_l1_thresh": 0.2})
    check_cache_config(get_plugin_manager(), cfg.cache_backend, cfg.cache_config)
    assert calls == [{"rel_l1_thresh": 0.2}]
    # a backend that declares no options is still asked (the built-in "none" takes anything)
    check_cache_config(get_plugin_manager(), "none", {"anything": 1})

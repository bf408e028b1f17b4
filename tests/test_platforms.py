"""Platform resolution: OMNI_PLATFORM, detection of plugin platforms, the CPU fallback, and the trace."""

from __future__ import annotations

import importlib.util
import types

import pytest

from omni_core import hookimpl
from omni_core.errors import ComponentUnavailableError, UnknownComponentError
from omni_core.platforms import PlatformResolutionError, Platform, resolve_platform
from omni_core.plugins.manager import create_plugin_manager
from omni_core.plugins.types import PlatformSpec


@pytest.fixture
def pm(dummy_plugins, monkeypatch):
    monkeypatch.setenv("OMNI_DISABLE_PLUGINS", "dummy-broken,dummy-conflict")
    return create_plugin_manager(strict=True)


def test_cpu_fallback_with_trace(pm):
    res = resolve_platform(pm)
    assert (res.name, res.platform.name, res.platform.device_type) == ("cpu", "cpu", "cpu")
    assert res.reason == "no accelerator platform detected; CPU fallback"
    assert "cpu (omni-core): built-in fallback, not auto-detected" in res.trace
    assert "dummy (omni-dummy-good): not detected: OMNI_DUMMY_PLATFORM is not 1" in res.trace


def test_detected_plugin_platform_wins(pm, monkeypatch):
    monkeypatch.setenv("OMNI_DUMMY_PLATFORM", "1")
    res = resolve_platform(pm)
    assert res.name == "dummy" and type(res.platform).__name__ == "DummyPlatform"
    assert res.reason == "the only detected platform"
    assert "dummy (omni-dummy-good): detected: OMNI_DUMMY_PLATFORM=1" in res.trace


def test_requested_platform(pm, monkeypatch):
    monkeypatch.setenv("OMNI_DUMMY_PLATFORM", "1")
    monkeypatch.setenv("OMNI_PLATFORM", "cpu")  # overrides detection
    res = resolve_platform(pm)
    assert (res.name, res.reason) == ("cpu", "requested explicitly")
    assert resolve_platform(pm, requested="dummy").name == "dummy"


def test_unknown_requested_platform_suggests(pm):
    with pytest.raises(UnknownComponentError, match="unknown platform 'dumy'; allowed: .*Did you mean 'dummy'"):
        resolve_platform(pm, requested="dumy")


def test_two_detected_platforms_are_an_error(pm, monkeypatch):
    monkeypatch.setenv("OMNI_DUMMY_PLATFORM", "1")
    pm.register_plugin(types.SimpleNamespace(omni_register_platforms=hookimpl(lambda: [PlatformSpec(
        name="dummy2", impl="omni_dummy_good.platform:DummyPlatform", detect="omni_dummy_good.platform:detect")])),
        "second", dist="omni-second")
    with pytest.raises(PlatformResolutionError, match="several platforms detected: dummy \\(omni-dummy-good\\), "
                                                      "dummy2 \\(omni-second\\); set OMNI_PLATFORM"):
        resolve_platform(pm)


def test_broken_detector_does_not_break_resolution(pm):
    pm.register_plugin(types.SimpleNamespace(omni_register_platforms=hookimpl(lambda: [PlatformSpec(
        name="crashy", impl="omni_dummy_good.platform:DummyPlatform", detect="omni_dummy_good.nope:detect")])),
        "crashy", dist="omni-crashy")
    res = resolve_platform(pm)
    assert res.name == "cpu"
    assert any(line.startswith("crashy (omni-crashy): not detected: detector raised ModuleNotFoundError")
               for line in res.trace)


def test_requested_platform_that_cannot_run(pm, monkeypatch):
    class Unavailable(Platform):
        name = "gone"

        def is_available(self):
            return False, "no device nodes"

    import sys

    module = types.ModuleType("omni_test_gone")
    module.Unavailable = Unavailable
    monkeypatch.setitem(sys.modules, "omni_test_gone", module)
    pm.register_plugin(types.SimpleNamespace(omni_register_platforms=hookimpl(lambda: [PlatformSpec(
        name="gone", impl="omni_test_gone:Unavailable", detect="omni_dummy_good.platform:detect")])), "gone", dist="g")
    with pytest.raises(ComponentUnavailableError, match="platform 'gone' was requested but cannot run here: no device"):
        resolve_platform(pm, requested="gone")


def test_current_platform_is_lazy_and_cached(omni_plugin_manager, monkeypatch):
    import omni_core.platforms as platforms

    monkeypatch.delenv("OMNI_PLATFORM", raising=False)
    first = platforms.current_platform
    assert first is platforms.current_platform  # cached
    assert platforms.current_resolution().platform is first
    assert first.describe()["available"] is True


def test_cpu_platform_basics():
    from omni_core.platforms.cpu import CpuPlatform

    cpu = CpuPlatform()
    assert cpu.dist_backend == "gloo"
    if importlib.util.find_spec("omni_attention_sdpa") is not None:  # the default is the installed records' best
        assert cpu.default_attention_backend(64, "float32") == "TORCH_SDPA"
    else:  # the core alone (check_dists): no kernel to default to, said with the plugin kind to install
        with pytest.raises(ComponentUnavailableError, match="plugin kind 'attention'"):
            cpu.default_attention_backend(64, "float32")
    stats = cpu.memory_stats()
    assert stats["total"] > 0 and stats["allocated"] > 0
    assert str(cpu.get_torch_device()) == "cpu"


def test_cuda_like_base_imports_no_torch():
    """GPU platform plugins import the core's CUDA-like base at module level: it must stay light."""
    import subprocess
    import sys

    code = ("import sys, omni_core.platforms.cuda_like as c; assert 'torch' not in sys.modules; "
            "assert c.CudaLikePlatform.device_type == 'cuda'")
    subprocess.run([sys.executable, "-c", code], check=True)

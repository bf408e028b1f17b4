"""The checks every platform plugin owes, as a class to subclass (as :class:`AttentionBackendContract` is for
kernels): detection through a substitutable probe with the reason it gives, resolution through the plugin
manager, and a clear error when the platform is asked for on a machine that lacks it.

A platform module keeps its environment facts behind a ``probe()`` function that ``detect()`` reads (so tests
can substitute a machine), and its ``hooks`` module registers the platform. A subclass names them::

    class TestRocmContract(PlatformContract):
        platform_module = omni_platform_rocm.platform   # has probe() and detect()
        hooks_module = omni_platform_rocm.hooks
        entry_point, dist = "platform-rocm", "omni-platform-rocm"
        platform_name, platform_class = "rocm", "RocmPlatform"
        detect_cases = [(RocmProbe(None, None, 0), False, "torch is not installed"), (ROCM_BOX, True, "8 AMD GPU")]
        detected_probe = ROCM_BOX
        unavailable_words = "platform 'rocm' was requested but cannot run here"
"""

from __future__ import annotations

from typing import Any, ClassVar


class PlatformContract:
    platform_module: ClassVar[Any]
    hooks_module: ClassVar[Any]
    entry_point: ClassVar[str]
    dist: ClassVar[str]
    platform_name: ClassVar[str]
    platform_class: ClassVar[str]
    #: ``(probe result, detected?, words the reason contains)`` for each machine the tests substitute
    detect_cases: ClassVar[list[tuple[Any, bool, str]]]
    #: a probe result of a machine where the platform is present
    detected_probe: ClassVar[Any]
    #: words of the error when the platform is requested here (``OMNI_PLATFORM``) and is absent
    unavailable_words: ClassVar[str]
    #: words the resolution trace holds when ``detected_probe`` is the machine (optional)
    detected_trace: ClassVar[str] = ""

    def fresh_pm(self) -> Any:
        """Built-ins plus this platform's plugin only, strict."""
        from omni_core.plugins.manager import OmniPluginManager

        pm = OmniPluginManager(strict=True)
        pm.load_builtins()
        pm.register_plugin(self.hooks_module, self.entry_point, dist=self.dist)
        return pm

    def test_registered_through_its_entry_point(self) -> None:
        from omni_core.plugins.manager import create_plugin_manager

        spec = create_plugin_manager(load_entrypoints=True, strict=True).get_component("platform", self.platform_name)
        assert spec.provider == self.dist and spec.load() is getattr(self.platform_module, self.platform_class)

    def test_detect_gives_its_reason(self, monkeypatch: Any) -> None:
        cls = getattr(self.platform_module, self.platform_class)
        for probe, detected, reason in self.detect_cases:
            monkeypatch.setattr(self.platform_module, "probe", lambda probe=probe: probe)
            ok, why = self.platform_module.detect()
            assert ok is detected and reason in why, (probe, ok, why)
            assert cls().is_available() == (ok, why)

    def test_the_only_detected_platform_wins(self, monkeypatch: Any) -> None:
        from omni_core.platforms import resolve_platform

        monkeypatch.delenv("OMNI_PLATFORM", raising=False)
        monkeypatch.setattr(self.platform_module, "probe", lambda: self.detected_probe)
        res = resolve_platform(self.fresh_pm())
        assert res.name == self.platform_name
        assert isinstance(res.platform, getattr(self.platform_module, self.platform_class))
        assert self.detected_trace in "\n".join(res.trace)

    def test_requesting_it_here_is_a_clear_error(self, monkeypatch: Any) -> None:
        import re

        import pytest

        from omni_core.errors import ComponentUnavailableError
        from omni_core.platforms import resolve_platform

        if self.platform_module.detect()[0]:
            pytest.skip(f"a {self.platform_name} device is present")
        monkeypatch.setenv("OMNI_PLATFORM", self.platform_name)
        with pytest.raises(ComponentUnavailableError, match=re.escape(self.unavailable_words)):
            resolve_platform(self.fresh_pm())

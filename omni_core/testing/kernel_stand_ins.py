"""Stand-in attention kernels for platform tests: a fast one and a portable one, as records, so a platform
plugin's tests check its default-kernel rule (which the records decide) without any attention plugin installed.

    with stand_in_kernels(fast_ok=True) as asked:
        assert CudaPlatform().default_attention_backend(128, None) == FAST
    assert asked == [(128, "bfloat16", (9, 0))]   # head size, dtype, capability the fast kernel was asked for
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator
from typing import Any

FAST, PORTABLE = "STAND_IN_FAST", "STAND_IN_PORTABLE"
_MODULE = "omni_core_testing_stand_in_kernels"


@contextlib.contextmanager
def stand_in_kernels(fast_ok: bool = True, *, fast_devices: tuple[str, ...] = ("cuda",)) -> Iterator[list[tuple]]:
    """Make the current plugin manager hold the built-ins plus a ``FAST`` kernel (default_priority 10, runs on
    ``fast_devices`` when ``fast_ok``) and a ``PORTABLE`` one (default_priority 0, portable); yields the list of
    ``(head size, dtype, capability)`` the fast kernel was walked with; restores the manager after."""
    from omni_core import hookimpl
    from omni_core.attention.backend import ALL_FLOAT_DTYPES, AttentionBackend
    from omni_core.plugins.manager import OmniPluginManager, set_plugin_manager
    from omni_core.plugins.types import AttentionBackendSpec

    asked: list[tuple] = []
    seen: dict[str, Any] = {}

    class Fast(AttentionBackend):
        name = FAST
        supported_devices = fast_devices
        supported_dtypes = ("float16", "bfloat16")

        @classmethod
        def is_available(cls) -> tuple[bool, str]:
            return fast_ok, "" if fast_ok else "the stand-in fast kernel is not installed"

        @classmethod
        def check_head_size(cls, head_size: int) -> str | None:
            seen["head_size"] = head_size
            return None

        @classmethod
        def check_call(cls, dtype: Any, device_type: str, has_mask: bool, causal: bool) -> str | None:
            seen["dtype"] = dtype
            asked.append((seen.get("head_size"), dtype, None))
            return super().check_call(dtype, device_type, has_mask, causal)

        @classmethod
        def check_capability(cls, capability: tuple[int, int]) -> str | None:
            asked[-1] = asked[-1][:2] + (capability,)
            return None

    class Portable(AttentionBackend):
        name = PORTABLE
        supported_dtypes = ALL_FLOAT_DTYPES

    module = types.ModuleType(_MODULE)
    module.Fast, module.Portable = Fast, Portable
    plugin = types.SimpleNamespace(omni_register_attention_backends=hookimpl(lambda: [
        AttentionBackendSpec(name=FAST, impl=f"{_MODULE}:Fast", default_priority=10),
        AttentionBackendSpec(name=PORTABLE, impl=f"{_MODULE}:Portable", default_priority=0, portable=True)]))
    pm = OmniPluginManager(strict=True)
    pm.load_builtins()
    pm.register_plugin(plugin, "stand-in-kernels", dist="omni-testing-stand-in-kernels")
    sys.modules[_MODULE] = module
    previous = set_plugin_manager(pm)
    try:
        yield asked
    finally:
        set_plugin_manager(previous)
        sys.modules.pop(_MODULE, None)


__all__ = ["FAST", "PORTABLE", "stand_in_kernels"]

"""Omni's plugin system: hook specs, registration records and the plugin manager.

Only ``hookspecs`` (pluggy) loads with this package; the manager (``importlib.metadata``) and the records
(attrs) load on first access, so ``import omni_core`` stays in the tens of milliseconds.
"""

from omni_core.plugins.hookspecs import PROJECT_NAME, hookimpl, hookspec

_MANAGER_NAMES = ("ENTRY_POINT_GROUP", "OmniPluginManager", "PluginInfo", "create_plugin_manager",
                  "get_installed_plugins", "get_plugin_manager", "reset_plugin_manager", "set_plugin_manager")
_TYPES_NAMES = ("KINDS", "KindSpec", "AttentionBackendSpec", "CacheBackendSpec", "ComponentSpec", "ExecutorSpec",
                "PipelineSpec", "PlatformSpec", "SchedulerSpec")

__all__ = ["PROJECT_NAME", "hookimpl", "hookspec", *_MANAGER_NAMES, *_TYPES_NAMES]


def __getattr__(name: str):
    if name in _MANAGER_NAMES:
        from omni_core.plugins import manager as module
    elif name in _TYPES_NAMES:
        from omni_core.plugins import types as module
    else:
        raise AttributeError(f"module 'omni_core.plugins' has no attribute {name!r}")
    value = getattr(module, name)
    globals()[name] = value
    return value

"""Omni's plugin system: hook specs, registration records and the plugin manager."""

from omni_core.plugins.hookspecs import PROJECT_NAME, hookimpl, hookspec
from omni_core.plugins.manager import (
    ENTRY_POINT_GROUP,
    OmniPluginManager,
    PluginInfo,
    create_plugin_manager,
    get_installed_plugins,
    get_plugin_manager,
    reset_plugin_manager,
    set_plugin_manager,
)
from omni_core.plugins.types import (
    KINDS,
    AttentionBackendSpec,
    CacheBackendSpec,
    ComponentSpec,
    ExecutorSpec,
    PipelineSpec,
    PlatformSpec,
    SchedulerSpec,
)

__all__ = [
    "ENTRY_POINT_GROUP", "KINDS", "PROJECT_NAME", "AttentionBackendSpec", "CacheBackendSpec", "ComponentSpec",
    "ExecutorSpec", "OmniPluginManager", "PipelineSpec", "PlatformSpec", "PluginInfo", "SchedulerSpec",
    "create_plugin_manager", "get_installed_plugins", "get_plugin_manager", "hookimpl", "hookspec",
    "reset_plugin_manager", "set_plugin_manager",
]

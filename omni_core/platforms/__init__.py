"""Platforms: the interface, the CPU fallback, and lazy resolution of ``current_platform``."""

from omni_core.platforms.interface import Platform
from omni_core.platforms.resolve import (
    PlatformResolution,
    PlatformResolutionError,
    check_world_size,
    current_resolution,
    platform_for,
    reset_current_platform,
    resolve_platform,
)

__all__ = ["Platform", "PlatformResolution", "PlatformResolutionError", "check_world_size", "current_platform",
           "current_resolution", "platform_for", "reset_current_platform", "resolve_platform"]


def __getattr__(name: str):
    # resolved on first access so that plugins can import the base class without triggering detection
    if name == "current_platform":
        return current_resolution().platform
    raise AttributeError(name)

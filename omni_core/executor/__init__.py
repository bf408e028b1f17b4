"""Executors: the interface and the built-in ``uni`` and ``mp`` executors (registered as plugins)."""

from omni_core.executor.base import DiffusionExecutor

__all__ = ["DiffusionExecutor"]

"""The diffusion engine: execution modes, busy loop, output streams, abort, warmup."""

from omni_core.engine.engine import DiffusionEngine, DiffusionExecutionMode, QueueFullError, make_engine

__all__ = ["DiffusionEngine", "DiffusionExecutionMode", "QueueFullError", "make_engine"]

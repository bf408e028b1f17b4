"""The diffusion engine: execution modes, busy loop, request handles, abort, warmup.

Front ends use only :mod:`omni_core.engine.client` (``EngineClient``, ``ModelInfo``, ``start_engine``).
"""

from omni_core.engine.engine import DiffusionEngine, DiffusionExecutionMode, RequestRecord, make_engine
from omni_core.engine.handle import RequestHandle
from omni_core.errors import QueueFullError  # its home is omni_core.errors; importable here as before

__all__ = ["DiffusionEngine", "DiffusionExecutionMode", "QueueFullError", "RequestHandle", "RequestRecord",
           "make_engine"]

"""The diffusion engine: its plan, execution modes, the core loop, request handles, abort, warmup.

Front ends use only :mod:`omni_core.engine.client` (``EngineClient``, ``ModelInfo``, ``start_engine``). The names
below load on first access, so importing the client (the server's one engine import) does not load the engine,
the loader and the runner with it.
"""

from __future__ import annotations

from omni_core.utils.lazy import lazy_dir, lazy_exports

_LAZY = {
    "DiffusionEngine": "omni_core.engine.engine:DiffusionEngine",
    "DiffusionExecutionMode": "omni_core.engine.engine:DiffusionExecutionMode",
    "EnginePlan": "omni_core.engine.plan:EnginePlan",
    "RequestRecord": "omni_core.engine.engine:RequestRecord",
    "make_engine": "omni_core.engine.engine:make_engine",
    "plan_engine": "omni_core.engine.plan:plan_engine",
    "RequestHandle": "omni_core.engine.handle:RequestHandle",
    "QueueFullError": "omni_core.errors:QueueFullError",  # its home is omni_core.errors; importable here as before
}

__all__ = sorted(_LAZY)
__getattr__ = lazy_exports(__name__, _LAZY)
__dir__ = lazy_dir(__name__, _LAZY)

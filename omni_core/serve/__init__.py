"""The OpenAI-compatible HTTP server (``omni serve``).

``build_app(engine)`` makes a FastAPI app for a ``DiffusionEngine`` (or ``AsyncOmni``/``Omni``);
``run_server`` serves it with uvicorn; ``ServerThread`` serves it on a background thread. FastAPI and
uvicorn are imported only when these are used, so ``import omni_core`` stays light.
"""

from __future__ import annotations

_LAZY = {
    "build_app": "omni_core.serve.app:build_app",
    "OmniServer": "omni_core.serve.omni_server:OmniServer",
    "run_server": "omni_core.serve.server:run_server",
    "ServerThread": "omni_core.serve.server:ServerThread",
    "APIError": "omni_core.serve.errors:APIError",
}

__all__ = list(_LAZY)


from omni_core.utils.lazy import lazy_exports  # noqa: E402

__getattr__ = lazy_exports(__name__, _LAZY)

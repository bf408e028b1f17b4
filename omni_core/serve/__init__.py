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
    "APIError": "omni_core.serve.protocol:APIError",
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'omni_core.serve' has no attribute {name!r}")
    import pkgutil

    value = pkgutil.resolve_name(target)
    globals()[name] = value
    return value

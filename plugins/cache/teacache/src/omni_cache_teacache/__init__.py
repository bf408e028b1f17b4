"""TeaCache for Omni (``cache_backend="tea_cache"``): per-request skip decisions and residual caches."""

__version__ = "0.1.0"

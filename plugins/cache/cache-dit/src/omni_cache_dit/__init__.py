"""cache-dit for Omni (``cache_backend="cache_dit"``): DBCache/TaylorSeer/SCM with one cache context per request."""

__version__ = "0.1.0"

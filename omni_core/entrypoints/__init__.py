"""User-facing Python API: ``Omni`` (blocking) and ``AsyncOmni`` (asyncio)."""

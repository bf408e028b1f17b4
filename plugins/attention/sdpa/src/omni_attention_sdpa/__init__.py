"""Omni attention backend ``TORCH_SDPA`` (the reference every other backend is checked against)."""

__version__ = "0.1.0"

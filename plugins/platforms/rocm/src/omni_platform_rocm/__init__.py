"""Omni platform ``rocm``: AMD ROCm GPUs."""

__version__ = "0.1.0"

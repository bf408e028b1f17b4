"""Omni platform ``cuda``: NVIDIA CUDA GPUs."""

__version__ = "0.1.0"

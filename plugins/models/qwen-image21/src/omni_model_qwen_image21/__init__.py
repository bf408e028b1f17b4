"""Omni model plugin: Qwen-Image 2.1 (diffusers ``QwenImage21Pipeline`` folders)."""

__version__ = "0.1.0"

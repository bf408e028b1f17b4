"""Omni model plugin: Qwen-Image (diffusers ``QwenImagePipeline`` folders)."""

__version__ = "0.1.0"

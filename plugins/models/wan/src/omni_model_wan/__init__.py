"""Omni model plugin: Wan 2.1 / Wan 2.2 text-to-video (diffusers ``WanPipeline`` folders)."""

__version__ = "0.1.0"

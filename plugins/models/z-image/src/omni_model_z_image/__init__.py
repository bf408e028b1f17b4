"""Omni model plugin: Z-Image and Z-Image-Turbo (diffusers ``ZImagePipeline`` folders)."""

__version__ = "0.1.0"

"""Omni model plugin: Wan 2.1 / Wan 2.2 text- and image-to-video (diffusers ``WanPipeline`` and
``WanImageToVideoPipeline`` folders)."""

__version__ = "0.1.0"

"""Omni model plugin: LTX-2 text- and image-to-video with its audio track (diffusers ``LTX2Pipeline`` and
``LTX2ImageToVideoPipeline`` folders). Importing the package imports nothing heavy."""

"""Omni's built-in demo model ``shapes``: one coloured shape on a light background from a prompt such as
``"a red circle in the top left"``. Small enough to train on a laptop CPU; its weights ship in the package."""

__version__ = "0.1.0"

"""The attention backend used when nothing names one (its home is :mod:`omni_core.plugins.attention_default`, below
the platforms that ask it)."""

from omni_core.plugins.attention_default import default_backend

__all__ = ["default_backend"]

"""Attention: the layer model code uses, the backend interfaces, and role-aware selection.

``Attention`` needs torch and is imported on first access.
"""

from omni_core.attention.backend import AttentionBackend, AttentionImpl, dtype_name

__all__ = ["Attention", "AttentionBackend", "AttentionImpl", "AttentionSelection", "dtype_name",
           "select_attention_backend"]


def __getattr__(name: str):
    if name == "Attention":
        from omni_core.attention.layer import Attention

        return Attention
    if name in ("AttentionSelection", "select_attention_backend"):
        from omni_core.attention import selector

        return getattr(selector, name)
    raise AttributeError(name)

"""Omni attention backend ``SAGE_ATTN``: SageAttention 2 (INT8 QK, FP8/FP16 PV) on CUDA."""

__version__ = "0.1.0"

"""Omni attention backend ``FLASH_ATTN``: FlashAttention 2 (flash-attn), 3 (flash_attn_interface) or aiter (ROCm)."""

__version__ = "0.1.0"

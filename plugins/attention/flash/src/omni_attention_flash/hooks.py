"""Entry-point module: registers ``FLASH_ATTN``. Imports nothing heavy (no torch, no flash-attn)."""

from omni_core import hookimpl
from omni_core.plugins.types import AttentionBackendSpec


@hookimpl
def omni_register_attention_backends():
    # `requires` names only torch: the kernel may come from flash_attn, flash_attn_interface (FA3) or aiter,
    # and FlashAttentionBackend.is_available() says which one is missing and why.
    return [AttentionBackendSpec(
        name="FLASH_ATTN",
        diffusers_backend="flash",  # diffusers' dispatcher name (the diffusers backend sets it)
        impl="omni_attention_flash.backend:FlashAttentionBackend",
        requires=("torch",),
        # preferred over the portable kernel wherever it runs (its own checks: library, dtype, head size, arch)
        default_priority=10,
        description="FlashAttention 2/3 on CUDA (aiter or flash-attn on ROCm); fp16/bf16, head sizes 8..256 "
                    "(multiples of 8), key-padding masks via varlen",
    )]

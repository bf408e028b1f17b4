"""Entry-point module: registers ``SAGE_ATTN``. Imports nothing heavy (no torch, no sageattention)."""

from omni_core import hookimpl
from omni_core.plugins.types import AttentionBackendSpec


@hookimpl
def omni_register_attention_backends():
    # `requires` names only torch: SageAttentionBackend.is_available() gives the better reason for sageattention
    # (missing, or PyPI's 1.x where 2.x is needed, or failing to import). No default_priority: its quantized
    # numbers differ from the reference's, so it runs only where a configuration names it.
    return [AttentionBackendSpec(
        name="SAGE_ATTN",
        diffusers_backend="sage",  # diffusers' dispatcher name (the diffusers backend sets it)
        impl="omni_attention_sage.backend:SageAttentionBackend",
        requires=("torch",),
        description="SageAttention 2 (quantized QK/PV) on CUDA sm80+; fp16/bf16, head sizes 64/96/128; no masks",
    )]

"""Entry-point module: only cheap records here, no torch."""

from omni_core import hookimpl
from omni_core.plugins.types import AttentionBackendSpec


@hookimpl
def omni_register_attention_backends():
    return [AttentionBackendSpec(
        name="TOY_ATTN",
        impl="omni_attention_toy.backend:ToyAttentionBackend",
        requires=("torch",),
        description="softmax(q k^T * scale) v in plain torch, float32 accumulation",
    )]

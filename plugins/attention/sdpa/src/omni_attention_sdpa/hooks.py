"""Entry-point module: registers ``TORCH_SDPA``. Imports nothing heavy."""

from omni_core import hookimpl
from omni_core.plugins.types import AttentionBackendSpec


@hookimpl
def omni_register_attention_backends():
    return [AttentionBackendSpec(
        name="TORCH_SDPA",
        diffusers_backend="native",  # diffusers' dispatcher name (the diffusers backend sets it)
        impl="omni_attention_sdpa.backend:TorchSDPABackend",
        requires=("torch",),
        # the portable kernel: the default wherever no faster backend passes its checks (CPU, NPU, float32)
        default_priority=0,
        portable=True,
        description="torch scaled_dot_product_attention; any device, head size and float dtype; masks",
    )]

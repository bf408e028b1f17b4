"""Entry-point module: registers the ``cuda`` platform. Imports nothing heavy (detection imports lazily)."""

from omni_core import hookimpl
from omni_core.plugins.types import PlatformSpec


@hookimpl
def omni_register_platforms():
    return [PlatformSpec(
        name="cuda",
        impl="omni_platform_cuda.platform:CudaPlatform",
        detect="omni_platform_cuda.platform:detect",
        requires=("torch",),
        description="NVIDIA GPUs (torch CUDA build); nccl; FLASH_ATTN or TORCH_SDPA by default",
    )]

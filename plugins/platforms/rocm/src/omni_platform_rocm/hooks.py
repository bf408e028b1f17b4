"""Entry-point module: registers the ``rocm`` platform. Imports nothing heavy (detection imports lazily)."""

from omni_core import hookimpl
from omni_core.plugins.types import PlatformSpec


@hookimpl
def omni_register_platforms():
    return [PlatformSpec(
        name="rocm",
        impl="omni_platform_rocm.platform:RocmPlatform",
        detect="omni_platform_rocm.platform:detect",
        requires=("torch",),
        description="AMD GPUs (torch ROCm build); nccl (RCCL); FLASH_ATTN or TORCH_SDPA by default",
    )]

"""Entry-point module: registers the ``npu`` platform. Imports nothing heavy (detection imports lazily)."""

from omni_core import hookimpl
from omni_core.plugins.types import PlatformSpec


@hookimpl
def omni_register_platforms():
    return [PlatformSpec(
        name="npu",
        impl="omni_platform_npu.platform:NpuPlatform",
        detect="omni_platform_npu.platform:detect",
        requires=("torch", "torch_npu"),
        description="Huawei Ascend NPUs (torch_npu); hccl; TORCH_SDPA by default",
    )]

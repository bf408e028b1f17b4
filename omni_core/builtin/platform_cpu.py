"""Built-in plugin: the CPU platform (the fallback when no accelerator platform is detected)."""

from omni_core.plugins.hookspecs import hookimpl
from omni_core.plugins.types import PlatformSpec


@hookimpl(trylast=True)
def omni_register_platforms():
    return [PlatformSpec(name="cpu", impl="omni_core.platforms.cpu:CpuPlatform",
                         description="CPU fallback; torch.distributed over gloo")]

"""``compile=True``: regional ``torch.compile`` of each denoiser's repeated blocks, with dynamic shapes.

Compiling one block class instead of the whole denoiser compiles once for all blocks (they share code), costs a
fraction of a full compile and keeps Python-level inputs (Qwen's ``img_shapes`` list) out of the guards, so a
step wave's changing batch size recompiles once (dynamo specialises size 1 first) and then stays dynamic
(cpu-notes §13). Each block is compiled in place with ``nn.Module.compile`` (what diffusers'
``compile_repeated_blocks`` does) from the :class:`~omni_core.pipelines.denoiser.DenoiserSpec`'s
``blocks_attr``, so every model gets it by declaration.

Compilation happens at the first call -- the start-up warm-up. If a compiled call raises and the same call
succeeds eagerly, compilation is at fault: every block returns to eager and a warning names the reason.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("omni_core.optimize")


class RegionalCompile:
    """The compiled blocks of one pipeline and the switch back to eager."""

    def __init__(self, blocks: list[Any]) -> None:
        self.blocks = blocks
        self.failed: str | None = None

    def fall_back(self, exc: BaseException) -> None:
        self.failed = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        logger.warning("compile=True: the compiled denoiser blocks failed (%s); running them eagerly", self.failed)
        for block in self.blocks:
            block._compiled_call_impl = None

    def guard(self, block: Any) -> None:
        compiled = block._compiled_call_impl

        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return compiled(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - decide below whether compilation is to blame
                out = block._call_impl(*args, **kwargs)  # raises (the model's own error) if eager fails too
                self.fall_back(exc)
                return out

        block._compiled_call_impl = call


def compile_denoisers(pipeline: Any, *, dynamic: bool = True) -> dict[str, Any]:
    """Compile every declared denoiser's blocks in place; returns what was done (for the start-up log)."""
    from omni_core.pipelines.denoiser import denoisers_of

    blocks, names = [], []
    for spec in denoisers_of(pipeline):
        for block in spec.blocks:
            block.compile(dynamic=dynamic)
            blocks.append(block)
        names.append(f"{spec.name}.{'+'.join(spec.blocks_attr)}")
    # CPU lanes run a wave's requests concurrently with fewer torch threads each; dynamo guards on the thread
    # count, so every lane change would recompile (and two lanes compile the same frame at once): one call per wave
    pipeline.concurrent_calls_safe = False
    region = RegionalCompile(blocks)
    for block in blocks:
        region.guard(block)
    pipeline.omni_compile = region  # tests and stats read region.failed
    return {"compile": "regional", "blocks": len(blocks), "regions": names, "dynamic": dynamic}

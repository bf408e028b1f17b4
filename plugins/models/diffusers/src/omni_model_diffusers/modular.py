"""Tier 2: a family diffusers offers as a modular pipeline, run on Omni's step-wise contract.

Diffusers' modular pipelines (``ModularPipeline``) are blocks: text encoding, preparing latents and timesteps, a
denoise loop (``LoopSequentialPipelineBlocks``) whose ``loop_step`` runs one step, and decoding. Resolved for a
request's inputs (``get_execution_blocks``), they split around the loop, and that is all step mode needs:
``prepare_encode`` runs the blocks before the loop on the request's own ``PipelineState``, each wave runs one
``loop_step`` per request, ``post_decode`` runs the blocks after it. Requests join and leave between steps, can be
preempted and resumed, and stream previews like a native model's.

What Omni writes itself, and why: per-request scheduler and guider copies (:class:`RequestComponents`). The blocks
read ``components.scheduler`` and ``components.guider``, which keep per-run state (the scheduler's step index and
sigmas, the guider's step); one pipeline's components shared by requests at different steps would mix them up.
Each request's denoiser call is its own (the blocks batch nothing across requests): waves interleave requests, they
do not fold them into one call as the native models do.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

#: what a request's inputs become in the modular pipeline's state (input name -> SamplingParams field)
CORE_INPUTS = {"height": "height", "width": "width", "num_inference_steps": "num_inference_steps",
               "num_frames": "num_frames", "max_sequence_length": "max_sequence_length"}


@functools.lru_cache(maxsize=None)
def modular_available(model_path: str) -> bool:
    """Whether diffusers offers the folder's family as a modular pipeline with default blocks (configs only)."""
    try:
        return modular_from_folder(model_path) is not None
    except Exception:  # noqa: BLE001 - no modular pipeline for this family: tier 1 only
        return False


def modular_from_folder(model_path: str) -> Any:
    """Diffusers' modular pipeline for the folder, without weights (None when its family has no blocks)."""
    from diffusers import ModularPipeline

    pipe = ModularPipeline.from_pretrained(model_path, trust_remote_code=False)
    return pipe if getattr(pipe, "blocks", None) is not None else None


def load_modular(model_path: str, standard: Any) -> Any:
    """The modular pipeline over the standard pipeline's loaded components (no second copy of any weight); the
    components only the modular one has (a guider) load from their defaults."""
    modular = modular_from_folder(model_path)
    shared = {name: standard.components[name] for name in modular.component_names
              if standard.components.get(name) is not None}
    modular.update_components(**shared)
    missing = [name for name in modular.component_names if name not in shared]
    if missing:
        modular.load_components(names=missing)
    modular.set_progress_bar_config(disable=True)
    return modular


class RequestComponents:
    """The modular pipeline as one request's blocks see it: its components, with this request's own scheduler
    and guider (both keep per-run state across steps)."""

    def __init__(self, pipe: Any, **own: Any) -> None:
        object.__setattr__(self, "_pipe", pipe)
        self.__dict__.update(own)

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "_pipe"), name)


class ModularRun:
    """One request's run through the modular blocks: its state, its components, the blocks around the loop."""

    def __init__(self, modular: Any, inputs: dict[str, Any], guidance_scale: float | None) -> None:
        from diffusers.modular_pipelines import LoopSequentialPipelineBlocks, PipelineState

        blocks = list(modular.blocks.get_execution_blocks(**inputs).sub_blocks.values())
        at = next(i for i, b in enumerate(blocks) if isinstance(b, LoopSequentialPipelineBlocks))
        self.before, self.loop, self.after = blocks[:at], blocks[at], blocks[at + 1:]
        own = {"scheduler": copy.deepcopy(modular.scheduler)}
        guider = getattr(modular, "guider", None) if "guider" in modular.component_names else None
        if guider is not None:
            guider = copy.deepcopy(guider)
            if guidance_scale is not None and hasattr(guider, "guidance_scale"):
                guider.guidance_scale = guidance_scale
            own["guider"] = guider
        self.components = RequestComponents(modular, **own)
        self.state = PipelineState()
        for param in modular.blocks.inputs:  # as ModularPipeline.__call__ fills its state
            if param.name is None:
                continue
            self.state.set(param.name, inputs.get(param.name, param.default), param.kwargs_type)
        self.block_state: Any = None

    def prepare(self) -> int:
        """The blocks before the loop; returns the number of steps."""
        import torch

        with torch.no_grad():
            for block in self.before:
                self.components, self.state = block(self.components, self.state)
            self.block_state = bs = self.loop.get_block_state(self.state)
            bs.num_warmup_steps = max(len(bs.timesteps) - bs.num_inference_steps * self.components.scheduler.order, 0)
        return len(bs.timesteps)

    def step(self, i: int) -> Any:
        """Loop step ``i``; returns the latents after it."""
        import torch

        with torch.no_grad():
            self.components, self.block_state = self.loop.loop_step(self.components, self.block_state, i=i,
                                                                    t=self.block_state.timesteps[i])
        return self.block_state.latents

    def finish(self) -> Any:
        """The blocks after the loop; returns the output tensor (``output_type="pt"``)."""
        import torch

        self.loop.set_block_state(self.state, self.block_state)
        with torch.no_grad():
            for block in self.after:
                self.components, self.state = block(self.components, self.state)
        for name in ("images", "videos"):
            value = self.state.get(name)
            if value is not None:
                return value
        raise RuntimeError("the modular pipeline's blocks made neither images nor videos")


__all__ = ["ModularRun", "RequestComponents", "load_modular", "modular_available"]

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

The stages apart (``encode_workers`` / ``decode_workers``) split the same blocks: the text blocks (those that expect
a text encoder) run in the encode process and their outputs travel with the request (:meth:`ModularRun.encode`);
the blocks after the loop run in the decode process on the final latents (:meth:`ModularRun.decode`). In line,
the text blocks run the same way in the model process's encoding window, so a request gives the same bits either
way.
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


def modular_class(class_name: str) -> str | None:
    """The modular pipeline class diffusers maps a standard pipeline class to (as ``ModularPipeline.from_pretrained``
    does for a standard folder), or None where it has none (the generic ``ModularPipeline`` has no blocks)."""
    from diffusers.modular_pipelines.modular_pipeline import MODULAR_PIPELINE_MAPPING
    from diffusers.pipelines.auto_pipeline import _get_model

    try:
        name = MODULAR_PIPELINE_MAPPING.get(_get_model(class_name))
    except Exception:  # noqa: BLE001 - a class auto-pipelines do not know
        return None
    if name is None:
        return None
    try:
        return name({"_class_name": class_name}) if callable(name) else name
    except Exception:  # noqa: BLE001 - a mapping that needs the folder's config to decide
        return None


STEP_MODE = ("step mode through diffusers' modular blocks ({modular}: requests join and leave between steps, "
             "preemption, the encode and decode stages apart), and request mode through the pipeline's own call")


def class_description(class_name: str) -> tuple[str, str]:
    """The record's ``class_description``: ``("modular steps", ...)`` where diffusers has modular blocks for the
    class's family, else ``("own call", ...)`` (tier 1 only)."""
    modular = modular_class(class_name)
    if modular is not None and modular != "ModularPipeline":
        return "modular steps", STEP_MODE.format(modular=modular)
    return "own call", ("the pipeline's own call: batched calls with one seed per request, aborts between steps, "
                        "previews, extra_args, cache-dit, a LoRA per call (no step mode: diffusers has no modular "
                        "blocks for this family)")


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
    # only what the standard pipeline does not define at all (a guider): a component it holds as None is another
    # stage's (encode_workers / decode_workers), never read here
    missing = [name for name in modular.component_names if name not in standard.components]
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

    def __init__(self, modular: Any, inputs: dict[str, Any], guidance_scale: float | None,
                 encodings: dict | None = None) -> None:
        from diffusers.modular_pipelines import LoopSequentialPipelineBlocks, PipelineState

        blocks = list(modular.blocks.get_execution_blocks(**inputs).sub_blocks.values())
        at = next(i for i, b in enumerate(blocks) if isinstance(b, LoopSequentialPipelineBlocks))
        self.before, self.loop, self.after = blocks[:at], blocks[at], blocks[at + 1:]
        #: the blocks that run a text encoder: their outputs are the request's text encodings
        self.text = [b for b in self.before if any(c.name.startswith(("text_encoder", "tokenizer"))
                                                   for c in b.expected_components)]
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
        if encodings is not None:  # computed by encode() (the encode stage's, or this process's window)
            self.before = [b for b in self.before if b not in self.text]
            for name, (value, kwargs_type) in encodings.items():
                self.state.set(name, value, kwargs_type)

    def text_key(self, guidance_scale: float | None) -> tuple:
        """What the text blocks' outputs depend on: their inputs' values and the guidance (a guider encodes the
        negative prompt only where it guides). Hashable, to key the encodings across processes."""
        names = sorted({p.name for b in self.text for p in b.inputs if p.name is not None})
        return ("modular-text", guidance_scale, *((n, self.state.get(n)) for n in names))

    def encode(self) -> dict:
        """Run the text blocks; ``{output name: (value, kwargs type)}``, what ``encodings=`` takes back."""
        import torch

        with torch.no_grad():
            for block in self.text:
                self.components, self.state = block(self.components, self.state)
        return {o.name: (self.state.get(o.name), o.kwargs_type) for b in self.text for o in b.intermediate_outputs}

    def decode(self, latents: Any) -> Any:
        """The blocks after the loop on final ``latents`` (the decode stage: no loop ran here)."""
        self.state.set("latents", latents)
        return self._after()

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
        self.loop.set_block_state(self.state, self.block_state)
        return self._after()

    def _after(self) -> Any:
        import torch

        with torch.no_grad():
            for block in self.after:
                self.components, self.state = block(self.components, self.state)
        for name in ("images", "videos"):
            value = self.state.get(name)
            if value is not None:
                return value
        raise RuntimeError("the modular pipeline's blocks made neither images nor videos")


__all__ = ["ModularRun", "RequestComponents", "class_description", "load_modular", "modular_available",
           "modular_class"]

"""What parity tests and the benchmark share: a family's call split into Omni's request fields, and diffusers' own call."""

from __future__ import annotations

from typing import Any

CORE = ("height", "width", "num_inference_steps", "guidance_scale", "num_frames", "max_sequence_length")
#: prompts of different lengths: padding must never leak into another row
PROMPTS = ["a cat", "a red car parked on a long street at night under the rain", "x",
           "a bowl of fruit on a wooden table in the morning sun"]


def omni_fields(call_kwargs: dict) -> dict[str, Any]:
    """``Omni.generate`` keywords for a family's call: core fields as themselves, the rest as ``extra_args``."""
    fields = {k: v for k, v in call_kwargs.items() if k in CORE}
    extra = {k: v for k, v in call_kwargs.items() if k not in CORE}
    return {**fields, "extra_args": extra} if extra else fields


def reference(path: str) -> Any:
    """Diffusers' own pipeline from the folder (safetensors only), quiet."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(path, use_safetensors=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def reference_call(pipe: Any, family: Any, prompts: list[str], seeds: list[int], image: Any = None, **extra) -> Any:
    """The pipeline's own output (``output_type="pt"``) for these prompts and seeds: one prompt as a user calls it
    (one generator), several as a batch with one generator per prompt."""
    import torch

    alone = len(prompts) == 1
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    kwargs = {**family.call_kwargs, **extra}
    if image is not None:
        kwargs["image"] = image if alone else [image] * len(prompts)
    out = pipe(prompt=prompts[0] if alone else prompts, generator=gens[0] if alone else gens, output_type="pt", **kwargs)
    return out.frames if family.video else out.images

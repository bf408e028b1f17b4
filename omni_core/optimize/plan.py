"""The load plan: one place that decides where each component's weights are at each moment of loading and in
which order the transforms apply, from the config alone.

Why a plan: when every option moved weights its own way, the loader read the whole model onto the accelerator
first and quantized or offloaded it afterwards, so a model too large for the device failed at load -- exactly
the case ``offload``, ``quantization`` and ``performance_mode="memory"`` exist for. diffusers' own offload and
torchao's ``quantize_(..., device=...)`` both start from the host; so does the plan whenever either is set:

1. ``read``     -- the pipeline's ``load`` reads the weights: to the host when a later step must start there
   (offload, quantization), else straight to the target device;
2. ``parallel`` -- the parallel config checked against the declared denoisers, and sequence-parallel hooks on
   them when the sp group has several ranks (no weights move);
3. ``quantize`` -- torchao weight-only on the named components; without offload each ``Linear`` is moved to the
   target just before it is quantized (so the float weights are never all there at once), with offload on the host;
4. ``vae``      -- VAE tiling / slicing (diffusers' switches, no weights move);
5. ``compile``  -- compile-stage hooks on the denoisers' blocks (installed before offload, so offload hooks
   stay outside the compiled region; compilation happens at the first call);
6. ``place`` or ``offload`` -- move what is still on the host to the target and make it the pipeline's
   execution device, or install the offload hooks (weights stay on the host and come in per call);
7. ``lora``     -- the configured adapters are attached by the worker after loading, on whatever device the
   denoiser is; offload hooks stay in place (:mod:`omni_core.optimize.offload`).

``omni env --model M --plan`` prints the plan for a config; ``load_pipeline`` runs it (``observe`` sees each
step, which the tests use to record parameter devices). Nothing here imports torch at import time.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import attrs

logger = logging.getLogger("omni_core.optimize")

#: the steps in the order they run (a plan holds a subsequence)
ACTIONS = ("read", "parallel", "quantize", "vae", "compile", "place", "offload", "lora")
HOST = "cpu"


@attrs.frozen
class LoadStep:
    """One step of a load plan: what it does to which components, and where their weights are after it."""

    action: str
    #: component names, or a group: "all", "denoisers", "vae"
    components: tuple[str, ...]
    #: where these components' weights are once the step is done
    device: str
    detail: str = ""

    def describe(self) -> str:
        return f"{self.action:<9} {', '.join(self.components):<24} -> {self.device:<10} {self.detail}".rstrip()


def _is_set(value: Any) -> bool:
    return value not in (None, "none", False)


def host_first(config: Any) -> bool:
    """Whether the weights must be read to the host: offload or quantization transforms them there first."""
    return _is_set(getattr(config, "offload", None)) or _is_set(getattr(config, "quantization", None))


def plan_load(config: Any, device: Any) -> list[LoadStep]:
    """The steps that load ``config.model`` for execution on ``device``, in order."""
    target = str(device)
    offload = getattr(config, "offload", None)
    offloading = _is_set(offload)
    read_to = HOST if host_first(config) else target
    gguf = getattr(config, "denoiser_weights", None)
    steps = [LoadStep("read", ("all",), read_to,
                      "weights from the model folder" + (f"; the denoiser from GGUF {gguf}" if gguf else ""))]
    parallel = getattr(config, "parallel_config", None)
    sp = parallel.sequence_parallel_size if parallel is not None else 1
    steps.append(LoadStep("parallel", ("denoisers",), read_to,
                          f"sequence parallel hooks (ulysses={parallel.ulysses_degree}, ring={parallel.ring_degree})"
                          if sp > 1 else "the parallel config checked against the declared denoisers"))
    method = getattr(config, "quantization", None)
    if _is_set(method):
        where = HOST if offloading else target
        how = ("on the host (offload brings them in per call)" if offloading
               else f"each Linear moved to {target}, then quantized")
        steps.append(LoadStep("quantize", tuple(config.quantize_components), where, f"torchao {method}: {how}"))
    tiling, slicing = getattr(config, "vae_tiling", None), getattr(config, "vae_slicing", None)
    if tiling or slicing:
        steps.append(LoadStep("vae", ("vae",), read_to, " + ".join(
            n for n, on in (("tiling", tiling), ("slicing", slicing)) if on)))
    if getattr(config, "compile", None):
        steps.append(LoadStep("compile", ("denoisers",), read_to,
                              "regional torch.compile hooks on the repeated blocks (compiled at the first call)"))
    if offloading:
        steps.append(LoadStep("offload", ("all",), HOST, f"{offload} offload hooks: weights come to {target} per "
                                                         f"call ({'whole components in turn' if offload == 'model' else 'one block at a time'})"))
    else:
        steps.append(LoadStep("place", ("all",), target,
                              "already there" if read_to == target else f"what is still on the host moves to {target}"))
    if getattr(config, "loras", None):
        steps.append(LoadStep("lora", ("denoisers",), HOST if offloading else target,
                              f"{min(len(config.loras), config.max_loras)} configured adapter(s) attached by the worker"))
    return steps


def freeze(pipeline: Any) -> None:
    """Every component's parameters without ``requires_grad``: the engine only runs inference. diffusers loads
    them requiring grad and peft turns that off when the first adapter loads, and dynamo guards on it: left as
    loaded, every graph compiled before the first LoRA request failed its guards after it and was compiled again."""
    from omni_core.optimize.components import components_of

    for module in components_of(pipeline).values():
        module.requires_grad_(False)


def run_plan(steps: list[LoadStep], resolved: Any, config: Any, device: Any, dtype: Any,
             observe: Callable[[LoadStep, Any], None] | None = None) -> Any:
    """Load ``resolved``'s pipeline by ``steps``; ``observe(step, pipeline)`` after each. Returns the pipeline,
    with what was applied in ``pipeline.omni_optimizations`` and the plan in ``pipeline.omni_load_plan``. The
    ``lora`` step is the worker's (it owns the adapters); here it is only recorded."""
    import attrs as _attrs
    import torch

    from omni_core.forward_context import use_config
    from omni_core.optimize import APPLIED_ATTR, load_kwargs

    applied: dict[str, Any] = {}
    pipeline = None
    for step in steps:
        if step.action == "read":
            cls = resolved.pipeline_cls()
            extra = load_kwargs(cls, resolved.model_path, config, dtype)  # a GGUF denoiser (denoiser_weights)
            load_config = (_attrs.evolve(config, model_kwargs={**config.model_kwargs, **extra}) if extra
                           else config)
            with use_config(config):
                pipeline = cls.load(resolved.model_path, load_config, torch.device(step.device), dtype)
            # where cache backends find the folder's shipped cache_defaults.json (pipelines/denoiser.py)
            setattr(pipeline, "omni_model_path", resolved.model_path)
            # the tiny decoder previews use, if the user named one (pipelines/preview.py)
            setattr(pipeline, "omni_preview_decoder", getattr(config, "preview_decoder", None))
            if getattr(config, "denoiser_weights", None):
                applied["denoiser_weights"] = config.denoiser_weights
            freeze(pipeline)
        elif step.action == "parallel":
            from omni_core.attention.parallel import apply_sequence_parallel_to_pipeline
            from omni_core.distributed.sharded_load import apply_tensor_parallel_to_pipeline

            # tensor parallelism first: Ulysses then splits each rank's local heads
            split = apply_tensor_parallel_to_pipeline(pipeline, config, torch.device(step.device), dtype)
            if split:
                applied["tensor_parallel"] = split
            apply_sequence_parallel_to_pipeline(pipeline, config)
        elif step.action == "quantize":
            from omni_core.optimize.quantize import quantize_pipeline

            on = None if step.device == HOST else torch.device(step.device)
            applied["quantization"] = {"method": config.quantization, "components": quantize_pipeline(
                pipeline, config.quantization, config.quantize_components, device=on)}
        elif step.action == "vae":
            from omni_core.optimize.vae import apply_vae_options

            applied.update(apply_vae_options(pipeline, config.vae_tiling, config.vae_slicing))
        elif step.action == "compile":
            from omni_core.optimize.compile import compile_denoisers

            applied.update(compile_denoisers(pipeline))
        elif step.action == "place":
            place(pipeline, device, move_weights=True)
        elif step.action == "offload":
            from omni_core.optimize.offload import apply_offload

            applied.update(apply_offload(pipeline, config.offload, device))
            place(pipeline, device, move_weights=False)
        if observe is not None and step.action != "lora":
            observe(step, pipeline)
    setattr(pipeline, APPLIED_ATTR, applied)
    setattr(pipeline, "omni_load_plan", steps)
    if applied:
        logger.info("memory/speed options applied: %s", applied)
    return pipeline


def place(pipeline: Any, device: Any, *, move_weights: bool) -> None:
    """``pipeline.place`` (:meth:`omni_core.pipelines.base.OmniPipeline.place`) on ``device``."""
    import torch

    pipeline.place(torch.device(device), move_weights=move_weights)


__all__ = ["ACTIONS", "LoadStep", "host_first", "place", "plan_load", "run_plan"]

"""Resolve ``model=`` to a registered pipeline and load it.

``model`` is a diffusers-format folder (its ``model_index.json`` ``_class_name`` names the pipeline) or a
short model name that a pipeline plugin registered (``"shapes"``).
"""

from __future__ import annotations

import os
from typing import Any

import attrs

from omni_core.errors import ConfigError, UnknownComponentError, suggest
from omni_core.pipelines.base import read_model_index
from omni_core.plugins.types import PipelineSpec, is_impl_ref, resolve_impl


@attrs.frozen
class ResolvedModel:
    spec: PipelineSpec
    model_path: str

    def pipeline_cls(self) -> type:
        """The pipeline class, checked against its record; a class with ``for_folder`` (a pipeline that serves any
        folder, ``PipelineSpec.serves_any_folder``) is specialized for this folder (its call's parameters, sizes,
        input images), which also refuses a folder it cannot run before any weight is read."""
        cls = self.spec.load()
        specialize = getattr(cls, "for_folder", None)
        return specialize(self.model_path) if specialize is not None else cls


def resolve_model(model: str, pm=None, pipeline: str | None = None) -> ResolvedModel:
    """``model`` (a folder or a registered model name) with the pipeline that runs it: ``pipeline`` when given
    (a registered name), else the pipeline named after the folder's ``model_index.json`` class, else the one
    installed pipeline that serves any folder (``PipelineSpec.serves_any_folder``)."""
    from omni_core.plugins.manager import get_plugin_manager

    pm = pm or get_plugin_manager()
    pipelines = pm.components("pipeline")
    installed = ", ".join(sorted(pipelines)) or "(none: install a model plugin, e.g. omni-model-shapes)"
    if pipeline is not None:
        spec = pm.get_component("pipeline", pipeline)
        path = os.path.abspath(model) if os.path.isdir(model) else resolve_model(model, pm).model_path
        return ResolvedModel(spec, path)
    if os.path.isdir(model):
        index = read_model_index(model)
        if index is None:
            raise ConfigError(f"model folder {model!r} has no model_index.json; a diffusers-format folder is "
                              f"expected. Installed pipelines: {installed}", field="model")
        class_name = index.get("_class_name")
        if class_name in pipelines:
            return ResolvedModel(pm.get_component("pipeline", class_name), os.path.abspath(model))
        fallback = sorted(name for name, spec in pipelines.items() if spec.serves_any_folder)
        if fallback:
            return ResolvedModel(pm.get_component("pipeline", fallback[0]), os.path.abspath(model))
        raise ConfigError(f"model folder {model!r} needs pipeline {class_name!r}, which no installed plugin "
                          f"provides (pip install omni-model-diffusers runs any diffusers pipeline). Installed "
                          f"pipelines: {installed}", field="model")
    names = {n: spec for spec in pipelines.values() for n in spec.model_names}
    if model in names:
        spec = names[model]
        if spec.default_model_path is None:
            raise ConfigError(f"pipeline {spec.name!r} registers model name {model!r} without a model path",
                              field="model")
        return ResolvedModel(pm.get_component("pipeline", spec.name), default_model_folder(spec, model))
    hint = suggest(model, names)
    raise ConfigError(
        f"model {model!r} is neither a folder nor a registered model name. Model names: "
        f"{', '.join(sorted(names)) or '(none)'}; installed pipelines: {installed}"
        + (f". Did you mean {hint!r}?" if hint else ""), field="model")


def default_model_folder(spec: PipelineSpec, model: str) -> str:
    """The folder behind a short model name: a plain path as given, or what the named function returns."""
    ref = spec.default_model_path
    path = str(resolve_impl(ref)()) if is_impl_ref(ref) else ref
    if not os.path.isdir(path):
        raise ConfigError(f"model name {model!r} ({spec.name}, from {spec.provider}) points to {path!r}, which is "
                          f"not a folder (default_model_path={ref!r})", field="model")
    return path


def check_parallel_support(resolved: ResolvedModel, parallel_config: Any) -> None:
    """Fail at start-up if the config asks for a parallel strategy the pipeline does not declare."""
    wanted = parallel_config.requested_strategies()
    # the registration record is the truth (a class restating it must agree: ComponentSpec.load checks)
    supported = set(resolved.spec.supported_parallel)
    unsupported = [s for s in wanted if s not in supported and s != "data"]
    if unsupported:
        raise ConfigError(
            f"pipeline {resolved.spec.name!r} does not support {', '.join(unsupported)} parallelism; it supports: "
            f"{', '.join(sorted(supported)) or 'none'} (data parallel always works)",
            field="parallel_config")
    check = getattr(resolved.pipeline_cls(), "check_parallel_config", None)
    if check is not None:  # model-specific limits (head counts), before any worker starts
        check(parallel_config, resolved.model_path)


def load_pipeline(resolved: ResolvedModel, config: Any, device: Any, dtype: Any, *,
                  observe: Any = None, stage: str | None = None) -> Any:
    """Load the pipeline by its load plan (:mod:`omni_core.optimize.plan`): read the weights (to the host when
    offload or quantization must start there), sequence parallelism from the declared denoiser specs,
    quantization, VAE options, compile, then place on ``device`` or install offload hooks. The read runs inside
    ``use_config`` so Attention layers see the config. In a worker this runs after ``init_parallel_state``.
    ``observe(step, pipeline)`` is called after each step (tests record where the weights are). ``stage``
    ("denoise", "encode" or "decode", with ``encode_workers`` / ``decode_workers``) loads one side of the split
    (:func:`_stage_load`)."""
    from omni_core.optimize.plan import plan_load, run_plan
    from omni_core.pipelines.embedding_cache import attach_embedding_cache
    from omni_core.pipelines.stages import DENOISE, ENCODE, declared_stages, drop_stage_components, stages_apart

    steps = plan_load(config, device)
    apart = stages_apart(config) if stage is not None else ()
    if stage is not None:
        config, steps, bare = _stage_load(resolved, config, device, dtype, stage, steps, apart)
        if bare is not None:
            return bare
    pipeline = run_plan(steps, resolved, config, device, dtype, observe=observe)
    cls = resolved.pipeline_cls()
    if stage in (DENOISE, ENCODE) and getattr(cls, "stage_load_kwargs", None) is None:  # loaded whole: let go
        from omni_core.optimize.components import components_of

        declared = declared_stages(cls, resolved.model_path)
        drop_stage_components(pipeline, [n for s in apart for n in declared.get(s, ()) if n not in
                                          declared.get(DENOISE, ())] if stage == DENOISE else
                              [n for n in components_of(pipeline) if n not in declared.get(ENCODE, ())])
    if stage is None or (stage == DENOISE and ENCODE not in apart):  # the encode stage keeps its own
        attach_embedding_cache(pipeline, config)  # the process's text-encoder output cache (embedding_cache_bytes)
    return pipeline


def _stage_load(resolved: ResolvedModel, config: Any, device: Any, dtype: Any, stage: str, steps: list,
                apart: tuple[str, ...]) -> tuple:
    """(config, load steps, a ready pipeline or None) for one side of the split. A pipeline with
    ``stage_load_kwargs`` (diffusers folders) reads its folder without the other sides' weights; one without
    loads whole (the model process then drops the split stages' components), except that a decode needing no
    components (``stage_components["decode"] == ()``, e.g. ``shapes``) is, on the decode side, an instance made
    without ``load`` (its decode reads only the state). A stage's side runs only the read and place steps (and
    the decode's VAE options); the model process runs the VAE options only when it decodes."""
    import attrs as _attrs

    from omni_core.pipelines.stages import DECODE, DENOISE, declared_stages

    cls = resolved.pipeline_cls()
    declared = declared_stages(cls, resolved.model_path)
    if stage == DENOISE:  # the VAE options go where the VAE runs (an image model's denoise side encodes with it)
        steps = [s for s in steps if not (s.action == "vae" and DECODE in apart and not declared.get(DENOISE))]
    else:
        steps = [s for s in steps if s.action in ("read", "place") or (s.action == "vae" and stage == DECODE)]
    kwargs_for = getattr(cls, "stage_load_kwargs", None)
    if kwargs_for is not None:
        extra = kwargs_for(resolved.model_path, stage, dtype, apart=apart)
        return _attrs.evolve(config, model_kwargs={**config.model_kwargs, **extra}), steps, None
    if stage == DECODE and declared.get(DECODE) == ():
        import torch

        bare = cls.__new__(cls)
        bare.device, bare.dtype = torch.device(device), dtype
        return config, steps, bare
    if stage == DECODE:
        raise ConfigError(f"pipeline {cls.__name__} declares decode components {declared.get(DECODE)} but no "
                          f"stage_load_kwargs to load them apart", field="decode_workers")
    return config, steps, None


__all__ = ["ResolvedModel", "UnknownComponentError", "check_parallel_support", "default_model_folder", "load_pipeline",
           "resolve_model"]

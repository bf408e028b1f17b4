"""Any diffusers pipeline, run through its own ``__call__`` (the generic backend, "tier 1").

Omni's native pipelines run their own step-wise denoise loop; a folder that no native plugin serves still runs
here, with the engine around it: admission checks, queueing, deadlines, aborts, batching, the server and the CLI.
What Omni writes itself, and why diffusers cannot do it:

* **the per-folder contract.** The engine checks a request before any work, so the call's signature becomes the
  class's rules (:func:`specialize`): which knobs a request may set (``extra_args``, checked by name and type),
  whether the pipeline takes an input image or makes videos, its default size, steps and guidance.
* **batching with per-request seeds.** Requests that share a call (same size, steps and options) go through one
  call, with one generator per request, so each row equals that request run alone: diffusers draws each row's
  noise from its own generator when given a list (``randn_tensor``).
* **aborts between steps.** The step-end callback reports progress and asks the runner which requests were
  aborted; a call whose requests are all aborted stops at once (a request aborted in a call shared with live
  ones comes back aborted when that call ends: rows of one diffusers call cannot be dropped mid-call).
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
from typing import Any, ClassVar

from omni_core.errors import ConfigError
from omni_core.images import ImageInput
from omni_core.outputs import DiffusionOutput
from omni_core.pipelines.base import OmniPipeline
from omni_core.pipelines.stages import diffusers_stage_kwargs, folder_stage_components, stages_apart
from omni_core.utils.denoisers import DIFFUSERS_DENOISERS
from omni_core.utils.diffusers_folder import read_model_index

from omni_model_diffusers.attention import dispatcher_backend, set_dispatcher_backend
from omni_model_diffusers.folder import default_side, size_rules
from omni_model_diffusers.modular import load_modular, modular_available
from omni_model_diffusers.stepwise import ModularSteps
from omni_model_diffusers.signature import OWN_PARAMETERS, call_refusal, check_value, pipeline_class, scalar_kind

logger = logging.getLogger("omni_model_diffusers")

class _AllStopped(Exception):
    """Raised from the step-end callback when every request of the call was aborted: the call ends now."""


@functools.lru_cache(maxsize=None)
def specialize(base: type, model_path: str) -> type:
    """``base`` specialized for the folder's pipeline: the call's parameters become the class's rules."""
    cls = pipeline_class(model_path)
    parameters = inspect.signature(cls.__call__).parameters
    refusal = call_refusal(cls)
    if refusal:
        raise ConfigError(f"{model_path!r}: {refusal}", field="model")

    def default(name: str, fallback: Any) -> Any:
        p = parameters.get(name)
        return p.default if p is not None and type(p.default) in (int, float) else fallback

    height, width, frames = size_rules(model_path)
    is_video = "num_frames" in parameters
    side = default_side(model_path)
    options = {name: scalar_kind(p) or "null" for name, p in parameters.items()
               if name not in OWN_PARAMETERS and p.kind is not p.VAR_KEYWORD and
               (scalar_kind(p) is not None or isinstance(p.default, (list, tuple, dict)))}
    attrs = {
        "diffusers_class": cls.__name__,
        "call_parameters": frozenset(parameters),
        "call_options": options,
        "is_video": is_video,
        "size_multiple": max(height, width),
        "frame_multiple": frames if is_video else 1,
        "default_height": default("height", side),
        "default_width": default("width", side),
        "default_num_frames": default("num_frames", 1 + 4 * frames) if is_video else None,
        "default_num_inference_steps": default("num_inference_steps", 50),
        "default_guidance_scale": default("guidance_scale", None),
        "image_input": ImageInput(role="the input image") if "image" in parameters else None,
        # warm up at 32 px (a multiple of every size rule diffusers' pipelines hard-code: SD's 8, LTX's and Sana's 32)
        "warmup_params": {"height": math.lcm(32, height), "width": math.lcm(32, width),
                          **({"num_frames": 1 + frames} if is_video else {})},
        "denoiser_names": tuple(n for n in DIFFUSERS_DENOISERS if n in (read_model_index(model_path) or {})),
        # tier 2: step mode through diffusers' modular blocks, where diffusers offers the family as such
        "supports_step_execution": modular_available(model_path),
        "per_prompt_outputs": next((n for n in ("num_images_per_prompt", "num_videos_per_prompt") if n in parameters),
                                   None),
        "__module__": base.__module__,
        "__doc__": f"{cls.__name__} from {model_path}, run through its own call.",
    }
    return type(cls.__name__, (base,), attrs)


class DiffusersCallPipeline(ModularSteps, OmniPipeline):
    """A diffusers pipeline run through its own ``__call__``; specialized per folder (:func:`specialize`)."""

    supports_step_execution: ClassVar[bool] = False
    supported_parallel: ClassVar[tuple[str, ...]] = ("ulysses", "ring")
    supports_request_batch: ClassVar[bool] = True
    #: previews come from the step-end callback's latents (``streaming_output`` stays in request mode)
    previews_in_request_mode: ClassVar[bool] = True
    #: set by :func:`specialize`: the diffusers class, its call's parameter names, the scalar ones a request may
    #: set through ``extra_args`` (name -> kind) and the name of its outputs-per-prompt parameter
    diffusers_class: ClassVar[str] = ""
    call_parameters: ClassVar[frozenset] = frozenset()
    call_options: ClassVar[dict] = {}
    per_prompt_outputs: ClassVar[str | None] = None

    @classmethod
    def for_folder(cls, model_path: str) -> type:
        return specialize(cls if not cls.diffusers_class else cls.__mro__[1], model_path)

    # ------------------------------------------------------------------ engine process
    @classmethod
    def stage_components_for(cls, model_path: str | None) -> dict[str, tuple[str, ...]]:
        """The stages apart split the modular blocks (tier 2): declared where the folder has them, else none."""
        if model_path is None or not modular_available(model_path):
            return {}
        return folder_stage_components(model_path, takes_images="image" in cls.call_parameters)

    @classmethod
    def stage_load_kwargs(cls, model_path: str, stage: str, dtype: Any, apart: tuple = ("decode",)) -> dict:
        import torch

        return diffusers_stage_kwargs(model_path, stage, cls.stage_components_for(model_path), dtype or torch.float32,
                                      apart)

    @classmethod
    def check_parallel_config(cls, parallel_config: Any, model_path: str | None = None) -> None:
        from omni_model_diffusers.parallel import check_context_parallel

        check_context_parallel(parallel_config, model_path, cls.diffusers_class or cls.__name__)

    @classmethod
    def check_sampling_params(cls, params: Any, model_path: str | None = None) -> Any:
        params = super().check_sampling_params(params, model_path)
        for name, field in (("guidance_scale", "guidance_scale"), ("max_sequence_length", "max_sequence_length")):
            if getattr(params, field) is not None and name not in cls.call_parameters:
                raise ConfigError(f"{field} is not a parameter of {cls.diffusers_class}.__call__; leave it unset",
                                  field=field)
        if (params.num_outputs_per_prompt or 1) > 1 and cls.per_prompt_outputs is None:
            raise ConfigError(f"{cls.diffusers_class} makes one output per prompt: num_outputs_per_prompt must be 1",
                              field="num_outputs_per_prompt")
        accepted = ", ".join(sorted(cls.call_options)) or "(none)"
        for name, value in params.extra_args.items():
            kind = cls.call_options.get(name)
            if kind is None:
                why = ("Omni sets it from the request's own field" if name in OWN_PARAMETERS else
                       "it is not a scalar parameter of the call" if name in cls.call_parameters else
                       "it is not a parameter of the call")
                raise ConfigError(f"extra_args {name!r} is refused for {cls.diffusers_class}: {why}; the call "
                                  f"parameters a request may set: {accepted}", field="extra_args")
            if not check_value(kind, value):
                kind = "null (to turn it off)" if kind == "null" else f"{kind} or null"
                raise ConfigError(f"extra_args {name!r} must be {kind} ({cls.diffusers_class}.__call__), got "
                                  f"{type(value).__name__} {value!r}", field="extra_args")
        return params

    @classmethod
    def check_images(cls, request: Any, limits: Any) -> Any:
        """Also key the batch on what one call shares beyond the core key: guidance and the call options."""
        request = super().check_images(request, limits)
        sp = request.sampling_params
        request.batch_extra = (*request.batch_extra, sp.guidance_scale, tuple(sorted(sp.extra_args.items())),
                               sp.lora, sp.lora_scale if sp.lora is not None else None)
        return request

    # ------------------------------------------------------------------ worker process
    def __init__(self, pipe: Any, device: Any, dtype: Any, loras: Any = None) -> None:
        self.pipe, self.device, self.dtype = pipe, device, dtype
        self.diffusers_call_pipeline = pipe
        #: the adapters of this pipeline (one per call: :mod:`omni_model_diffusers.loras`), or None
        self.loras = loras

    @classmethod
    def load(cls, model_path: str, config: Any = None, device: Any = "cpu", dtype: Any = None) -> OmniPipeline:
        import diffusers
        import torch

        from omni_core.utils.diffusers_folder import dtype_kwarg

        kwargs = dict(getattr(config, "model_kwargs", None) or {})
        pipe = getattr(diffusers, cls.diffusers_class).from_pretrained(
            model_path, **dtype_kwarg(dtype or torch.float32), use_safetensors=True, **kwargs)
        pipe.set_progress_bar_config(disable=True)
        pipe.to(torch.device(device))
        backend = dispatcher_backend(config)
        if backend is not None:
            set_dispatcher_backend(pipe, *backend)
        parallel = getattr(config, "parallel_config", None)
        if parallel is not None and parallel.ulysses_degree * parallel.ring_degree > 1:
            from omni_model_diffusers.parallel import enable_context_parallel

            enable_context_parallel(pipe.transformer, parallel)  # every rank runs the same call
        modular = None
        # step mode (modes.mode_for): asked for, or streaming with modular blocks to stream from
        step_mode = config is not None and config.uses_step_execution and cls.supports_step_execution
        if step_mode and config.cache_backend != "none":
            raise ConfigError(f"cache_backend={config.cache_backend!r} cannot run in step mode on the diffusers "
                              f"backend: cache-dit's adapter refreshes its context per pipeline call, and the modular "
                              f"blocks' steps make none; use request mode (step_execution=False, no "
                              f"streaming_output)", field="cache_backend")
        if config is not None and stages_apart(config) and not step_mode:
            raise ConfigError(f"{stages_apart(config)[0]}_workers: the stages apart split {cls.diffusers_class}'s "
                              f"modular blocks, which run in step mode only; set step_execution=True (or run the "
                              f"stages in line)", field=f"{stages_apart(config)[0]}_workers")
        if step_mode:
            modular = load_modular(model_path, pipe)  # step mode: the modular blocks over the same components
        loras = None
        if config is not None and hasattr(pipe, "load_lora_weights"):
            from omni_model_diffusers.loras import CallLoras

            loras = CallLoras(pipe, config)
            loras.preload()
        pipeline = cls(pipe, torch.device(device), dtype, loras)
        pipeline.modular = modular
        if getattr(pipe, "transformer", None) is not None:
            from omni_model_diffusers.parallel import context_parallel_metrics

            pipeline.call_metrics = context_parallel_metrics(pipe.transformer)
        return pipeline

    def forward(self, batch: list, control: Any = None) -> list[DiffusionOutput]:
        from omni_core.pipelines.base import _NoControl

        control = control or _NoControl()
        for state in batch:
            state.num_steps = state.sampling_params.num_inference_steps
            control.on_encoded(state)
        stopped = control.stopped([s.request_id for s in batch])
        outs: dict[str, DiffusionOutput] = {}
        groups: dict[tuple, list] = {}
        for state in batch:
            if state.request_id not in stopped:
                groups.setdefault(self.call_key(state), []).append(state)
        for group in groups.values():
            outs.update(self.run_call(group, control))
        return [outs.get(s.request_id) or DiffusionOutput(request_id=s.request_id, status="aborted", finished=True,
                                                          step_index=s.step_index, num_steps=s.num_steps)
                for s in batch]

    #: what every request run through the call reports (the context parallelism diffusers installed)
    call_metrics: dict = {}

    def preview(self, state: Any) -> Any:
        """The step's preview (:func:`omni_core.pipelines.preview.render_preview`: the model folder's or plugin's
        latent projection, else the latent channels scaled); None when the latents cannot be shown."""
        from omni_core.pipelines.preview import render_latents

        latents = self.preview_latents(state)
        if latents is None:
            return None
        import torch

        with torch.no_grad():
            return render_latents(self, latents)

    @staticmethod
    def call_key(state: Any) -> tuple:
        """What requests sharing one call must agree on (everything but prompt and seed)."""
        sp, request = state.sampling_params, state.request
        images = tuple(tuple(im.shape) for im in request.images)
        return (sp.height, sp.width, sp.num_frames, sp.num_inference_steps, sp.guidance_scale, sp.max_sequence_length,
                sp.num_outputs_per_prompt or 1, request.negative_prompt is None, images,
                tuple(sorted(sp.extra_args.items())), sp.lora, float(sp.lora_scale) if sp.lora is not None else None)

    def call_kwargs(self, group: list) -> dict[str, Any]:
        """The call's arguments for requests sharing it: a lone request's exactly as a user would pass them."""
        sp, alone = group[0].sampling_params, len(group) == 1
        kwargs: dict[str, Any] = dict(sp.extra_args)
        prompts = [s.request.prompt for s in group]
        kwargs["prompt"] = prompts[0] if alone else prompts
        if group[0].request.negative_prompt is not None:
            negatives = [s.request.negative_prompt for s in group]
            kwargs["negative_prompt"] = negatives[0] if alone else negatives
        kwargs.update(height=sp.height, width=sp.width, num_inference_steps=sp.num_inference_steps)
        for name in ("guidance_scale", "max_sequence_length", "num_frames"):
            if getattr(sp, name) is not None and name in self.call_parameters:
                kwargs[name] = getattr(sp, name)
        if (sp.num_outputs_per_prompt or 1) > 1:
            kwargs[self.per_prompt_outputs] = sp.num_outputs_per_prompt
        kwargs["generator"] = group[0].generator if alone else [s.generator for s in group]
        if group[0].request.images:  # uint8 [3, H, W] as checked by the engine: the caller's pixels, as PIL
            from PIL import Image

            images = [Image.fromarray(s.request.images[0].permute(1, 2, 0).contiguous().numpy()) for s in group]
            kwargs["image"] = images[0] if alone else images
        return kwargs

    #: the pipeline accepts a list of input images (one per prompt); found out by the first batched call that
    #: carries images (Wan's image-to-video takes exactly one image per call), then remembered
    takes_image_lists: bool | None = None

    def run_call(self, group: list, control: Any) -> dict[str, DiffusionOutput]:
        """``group`` through one call, or one call each where the pipeline takes one input image per call."""
        if len(group) == 1 or not group[0].request.images or self.takes_image_lists is False:
            return self.call(group, control) if len(group) == 1 or not group[0].request.images else {
                k: v for s in group for k, v in self.call([s], control).items()}
        try:
            outs = self.call(group, control)
        except (TypeError, ValueError) as exc:
            if self.takes_image_lists:
                raise
            logger.info("%s takes one input image per call (%s): its image requests run one call each",
                        self.diffusers_class, exc)
            self.takes_image_lists = False
            return self.run_call(group, control)
        self.takes_image_lists = True
        return outs

    def call(self, group: list, control: Any) -> dict[str, DiffusionOutput]:
        """One call of the diffusers pipeline for ``group``; progress and aborts through its step callback."""
        gone: set[str] = set()

        rows = group[0].sampling_params.num_outputs_per_prompt or 1

        def at_step(step: int, latents: Any) -> None:
            total = getattr(self.pipe, "_num_timesteps", None)
            for i, state in enumerate(group):
                state.step_index = step + 1
                if isinstance(total, int) and total > 0:
                    state.num_steps = total
                if latents is not None:  # this request's rows, for its preview (a view: no copy)
                    state.latents = latents[i * rows:(i + 1) * rows]
                control.on_step(state)
            live = [s.request_id for s in group if s.request_id not in gone]
            gone.update(control.stopped(live))
            if len(gone) == len(group):
                raise _AllStopped

        kwargs = self.call_kwargs(group)
        sp = group[0].sampling_params
        if self.loras is not None:
            self.loras.use(sp.lora, float(sp.lora_scale))
        if "callback_on_step_end" in self.call_parameters:
            def on_step_end(pipe: Any, step: int, timestep: Any, tensors: dict) -> dict:
                at_step(step, tensors.get("latents"))
                return tensors
            kwargs["callback_on_step_end"] = on_step_end
        elif "callback" in self.call_parameters:  # the older per-step callback (callback_steps)
            kwargs.update(callback=lambda step, timestep, latents: at_step(step, latents), callback_steps=1)
        try:
            result = self.pipe(**kwargs, output_type="pt", return_dict=True)
        except _AllStopped:
            return {}
        for state in group:
            state.latents = None  # the call's latents: not kept past it
        tensor = result.frames if self.is_video else result.images
        n = group[0].sampling_params.num_outputs_per_prompt or 1
        outs = {}
        for i, state in enumerate(group):
            if state.request_id in gone:
                continue
            state.step_index = state.num_steps
            outs[state.request_id] = DiffusionOutput(request_id=state.request_id, tensor=tensor[i * n:(i + 1) * n],
                                                     finished=True, step_index=state.step_index,
                                                     num_steps=state.num_steps, metrics=dict(self.call_metrics))
        return outs


__all__ = ["DiffusersCallPipeline", "specialize"]

"""The pipeline contract every model plugin implements.

Two ways to run a model share one implementation:

* **step-wise** (STEP_BATCH): ``prepare_encode`` once per request, then ``denoise_step`` over a batch of
  requests that may be at different steps, ``step_scheduler`` per request, ``post_decode`` when done;
* **request batch** (REQUEST_BATCH): ``forward(batch)`` runs whole requests. The default ``forward`` is
  the same step-wise loop, so a model writes its denoising logic once; the runner's ``control`` is
  consulted between steps so an aborted request stops within one step.

Class-level ``check_sampling_params`` and ``post_process`` run in the engine's process (before any work
and after the result arrives); everything else runs where the model lives (a worker).
"""

from __future__ import annotations

import contextlib
from typing import Any, ClassVar, ContextManager, Protocol

import attrs

from omni_core.config import RequestLimits, SamplingParams, check_sampling_field, registered_sampling_fields
from omni_core.errors import ConfigError
from omni_core.images import ImageInput, tensor_to_pil
from omni_core.outputs import DiffusionOutput
from omni_core.pipelines.diffusers_folder import read_model_index  # noqa: F401 (model plugins import it here)
from omni_core.pipelines.state import StepState
from omni_core.request import OmniDiffusionRequest
from omni_core.sampling_fields import SamplingField


class StepControl(Protocol):
    """What the runner gives ``forward``: which requests to stop (asked once per step) and a per-step callback.

    ``stopped`` is called at the same point on every rank, so a multi-process runner can agree on the answer.
    """

    def stopped(self, request_ids: list[str]) -> set[str]: ...

    def on_encoded(self, state: StepState) -> None: ...

    def on_step(self, state: StepState) -> None: ...


class _NoControl:
    def stopped(self, request_ids: list[str]) -> set[str]:
        return set()

    def on_encoded(self, state: StepState) -> None:
        pass

    def on_step(self, state: StepState) -> None:
        pass


class OmniPipeline:
    """Base class of Omni pipelines. Subclasses implement ``load`` and the four step-wise methods."""

    #: ``forward`` accepts several independent requests at once
    supports_request_batch: ClassVar[bool] = True
    #: implements ``prepare_encode`` / ``denoise_step`` / ``step_scheduler`` / ``post_decode``
    supports_step_execution: ClassVar[bool] = True
    #: ``denoise_step`` / ``forward`` may run on two sub-batches at once in two threads (no per-call state kept
    #: on the pipeline or its modules): lets a CPU wave use one lane per core (``omni_core.worker.lanes``)
    concurrent_calls_safe: ClassVar[bool] = False
    #: this process's text-encoder output cache (:mod:`omni_core.pipelines.embedding_cache`), set by the loader
    #: from ``embedding_cache_bytes``; None: off. A pipeline's ``encoded_prompts`` window reads it
    embedding_cache: Any = None
    #: parallel strategies supported: any of "ulysses", "ring", "cfg", "data"
    supported_parallel: ClassVar[tuple[str, ...]] = ()
    #: requests may ask for a rollout (``SamplingParams.rollout``): the model advances its latents through the
    #: core's flow step (``omni_core.pipelines.rollout.flow_step``); ``check_rollout`` refuses what it cannot follow
    supports_rollout: ClassVar[bool] = False
    #: height and width must be multiples of this
    size_multiple: ClassVar[int] = 16
    is_video: ClassVar[bool] = False
    default_height: ClassVar[int] = 512
    default_width: ClassVar[int] = 512
    default_num_frames: ClassVar[int | None] = None
    #: num_frames must satisfy (num_frames - 1) % frame_multiple == 0 (video models)
    frame_multiple: ClassVar[int] = 1
    default_num_inference_steps: ClassVar[int] = 50
    default_guidance_scale: ClassVar[float | None] = None
    #: the model's own sampling knobs; the same constant as its ``PipelineSpec.sampling_fields`` (a light
    #: module holds it, so the record needs no pipeline import). ``check_model_fields`` validates them.
    sampling_fields: ClassVar[tuple[SamplingField, ...]] = ()
    #: appended to the refusal of a sampling field another model declares (e.g. "use guidance_scale")
    undeclared_field_hint: ClassVar[str] = ""
    #: per-model request limits (``RequestLimits`` field names) overriding the safe defaults of
    #: ``request_limits``; e.g. ``{"max_pixels": 1280 * 720, "max_frames": 121}``
    default_limits: ClassVar[dict[str, int]] = {}
    #: the input images a request carries (edit and image-to-video models); None: the model takes none, and a
    #: request with images is refused naming the ``image`` field
    image_input: ClassVar[ImageInput | None] = None
    #: ``forward`` computes ``preview(state)`` at the steps it reports through ``control.on_step`` when asked
    #: (``streaming_output``): a pipeline without step mode (its loop is its own) then streams previews in request
    #: mode; the runner sends them with the progress events
    previews_in_request_mode: ClassVar[bool] = False
    #: the diffusers pipeline whose own ``__call__`` runs each wave (the diffusers backend), or None (Omni's own
    #: loop: ``denoisers()`` declares what accelerators hook). A cache backend that works on a whole diffusers
    #: pipeline (cache-dit's own adapters) attaches here when no denoiser is declared
    diffusers_call_pipeline: Any = None

    #: base defaults: 200 steps is 4x the usual 50-step schedule; 4 outputs per prompt; 4096 characters is
    #: far beyond what a text encoder reads (Qwen-Image and Wan truncate at 512-1024 tokens)
    BASE_MAX_STEPS: ClassVar[int] = 200
    BASE_MAX_OUTPUTS: ClassVar[int] = 4
    BASE_MAX_PROMPT_CHARS: ClassVar[int] = 4096
    #: 16 MP per input image: beyond any model's working size (inputs are resized to it), and it bounds the
    #: decode and resize a request costs the engine's process
    BASE_MAX_IMAGE_PIXELS: ClassVar[int] = 4096 * 4096

    @classmethod
    def request_limits(cls, configured: Any = None) -> RequestLimits:
        """The effective limits: ``configured`` (a ``RequestLimits``/dict; None fields fall through), then
        ``default_limits``, then defaults derived from the model: 4x the default output area (2x each side),
        twice the default clip length for video (1 frame for images), and the BASE_* values."""
        frames = 2 * (cls.default_num_frames - 1) + 1 if cls.is_video and cls.default_num_frames else 1
        base = {"max_pixels": 4 * cls.default_height * cls.default_width, "max_frames": frames,
                "max_steps": cls.BASE_MAX_STEPS, "max_outputs": cls.BASE_MAX_OUTPUTS,
                "max_prompt_chars": cls.BASE_MAX_PROMPT_CHARS, "max_image_pixels": cls.BASE_MAX_IMAGE_PIXELS}
        model = RequestLimits.coerce(cls.default_limits).resolved(base)  # also checks default_limits' keys
        return RequestLimits.coerce(configured).resolved(attrs.asdict(model))

    # ------------------------------------------------------------------ engine process
    @classmethod
    def size_multiples(cls, model_path: str | None = None) -> tuple[int, int, int]:
        """``(height multiple, width multiple, frame multiple)`` for the folder. Default: the class's
        ``size_multiple`` (16 unless set) and ``frame_multiple``. A model whose folder decides (a VAE factor, a
        patch size) overrides this with the same function its record's ``size_rules`` names, so the base
        ``check_sampling_params`` and the start-up warm-up follow the folder too."""
        return cls.size_multiple, cls.size_multiple, cls.frame_multiple

    @classmethod
    def default_size(cls, model_path: str | None = None) -> tuple[int, int]:
        """``(height, width)`` a request gets when it gives none. Default: the class's ``default_height`` and
        ``default_width``; override to read the folder (diffusers' ``sample_size * vae_scale_factor``)."""
        return cls.default_height, cls.default_width

    @classmethod
    def check_rollout(cls, params: SamplingParams, model_path: str | None) -> None:
        """Refuse a rollout this model's folder cannot sample (``supports_rollout`` models; default: any)."""

    @classmethod
    def check_sampling_params(cls, params: SamplingParams, model_path: str | None = None) -> SamplingParams:
        """Fill in the model's defaults and reject what the model cannot do (before any work starts). The size
        defaults and multiples come from :meth:`default_size` and :meth:`size_multiples` of the folder, so an
        override of those two keeps this usable through ``super()``."""
        changes: dict[str, Any] = {}
        if params.height is None or params.width is None:
            height, width = cls.default_size(model_path)
            if params.height is None:
                changes["height"] = height
            if params.width is None:
                changes["width"] = width
        if params.num_inference_steps is None:
            changes["num_inference_steps"] = cls.default_num_inference_steps
        if params.guidance_scale is None and cls.default_guidance_scale is not None:
            changes["guidance_scale"] = cls.default_guidance_scale
        if cls.is_video and params.num_frames is None:
            changes["num_frames"] = cls.default_num_frames
        params = params.replace(**changes) if changes else params
        params = cls.check_model_fields(params)
        if params.rollout is not None:
            if not cls.supports_rollout:
                raise ConfigError(f"rollout: {cls.__name__} does not advance its latents through the core's flow step "
                                  f"(supports_rollout), so it cannot sample a rollout with log-probabilities; leave "
                                  f"rollout unset", field="rollout")
            cls.check_rollout(params, model_path)
        hm, wm, frame_multiple = cls.size_multiples(model_path)
        for name, m in (("height", hm), ("width", wm)):
            value = getattr(params, name)
            if value % m:
                lo, hi = value // m * m, (value // m + 1) * m
                raise ConfigError(f"{name}={value} is not allowed for {cls.__name__}: it must be a multiple of {m} "
                                  f"(e.g. {lo or m} or {hi})", field=name)
        if params.num_frames is not None:
            if not cls.is_video and params.num_frames != 1:
                raise ConfigError(f"num_frames={params.num_frames} is not allowed: {cls.__name__} makes images "
                                  f"(leave num_frames unset or 1)", field="num_frames")
            if cls.is_video and (params.num_frames - 1) % frame_multiple:
                raise ConfigError(f"num_frames={params.num_frames} is not allowed for {cls.__name__}: num_frames - 1 "
                                  f"must be a multiple of {frame_multiple} (e.g. "
                                  f"{(params.num_frames - 1) // frame_multiple * frame_multiple + 1})",
                                  field="num_frames")
        return params

    @classmethod
    def check_images(cls, request: OmniDiffusionRequest, limits: RequestLimits) -> OmniDiffusionRequest:
        """Check the request's input images against ``image_input`` and the limits (engine process, before any
        work), then give the request their transport form (``uint8`` tensors) and their batch-key part. Runs once
        per request: the engine does not check a prepared request again."""
        from omni_core import images as im

        im.check_images(request.images, cls.image_input, model=cls.__name__, max_image_pixels=limits.max_image_pixels)
        if request.images:
            request.batch_extra = cls.image_input.batch_key(request.images)
            request.images = [im.to_tensor(image) for image in request.images]
        return request

    @classmethod
    def check_model_fields(cls, params: SamplingParams) -> SamplingParams:
        """The model-declared part of ``check_sampling_params`` (call it from an override): refuse a field this
        model does not declare, validate the rest against ``sampling_fields``, fill their defaults and record
        the declarations on the params (the schedulers key batches on those with ``splits_batch``)."""
        mine = {f.name: f for f in cls.sampling_fields}
        core = {a.name for a in attrs.fields(SamplingParams)}
        for name in mine:
            if name in core:
                raise ConfigError(f"{cls.__name__}.sampling_fields declares {name!r}, a core SamplingParams field; "
                                  f"a model declares only knobs of its own", field=name)
        for name, value in params.model_fields.items():
            if name not in mine:
                raise ConfigError(cls.undeclared_field_message(name), field=name)
            check_sampling_field(params, mine[name], value)
        defaults = {n: f.default for n, f in mine.items() if n not in params.model_fields and f.default is not None}
        specs = tuple(mine.values())
        if not defaults and params.model_field_specs == specs:
            return params
        return attrs.evolve(params, model_fields={**params.model_fields, **defaults}, model_field_specs=specs)

    @classmethod
    def undeclared_field_message(cls, name: str) -> str:
        """Why ``name`` (a sampling field some other model declares) is refused here, and what to use."""
        owners = [f"{pipeline}: {field.help}" if field.help else pipeline
                  for pipeline, field in registered_sampling_fields().get(name, []) if pipeline != cls.__name__]
        text = f"{name} is not used by {cls.__name__}" + (f" (declared by {'; '.join(owners)})" if owners else "")
        if cls.undeclared_field_hint:
            return f"{text}; {cls.undeclared_field_hint}"
        own = ", ".join(f.name for f in cls.sampling_fields)
        return f"{text}; {cls.__name__}'s own sampling fields: {own}" if own else text

    @classmethod
    def check_parallel_config(cls, parallel_config: Any, model_path: str | None = None) -> None:
        """Reject a parallel config this model cannot run (e.g. a Ulysses degree that does not divide the
        denoiser's head count) with a ``ConfigError``, in the engine's process before any worker starts.
        ``supported_parallel`` is checked separately; the default accepts everything."""

    @classmethod
    def post_process(cls, output: DiffusionOutput, request: OmniDiffusionRequest) -> DiffusionOutput:
        """Turn the raw tensor into what ``output_type`` asks for (PIL by default)."""
        if not output.finished or output.tensor is None:
            return output
        kind = request.sampling_params.output_type
        if kind in ("pt", "latent"):
            output.images = list(output.tensor)
        elif kind == "np":
            output.images = [t.float().cpu().numpy() for t in output.tensor]
        else:
            output.images = [tensor_to_pil(t) for t in output.tensor]
        return output

    # ------------------------------------------------------------------ worker process
    @classmethod
    def load(cls, model_path: str, config: Any, device: Any, dtype: Any) -> OmniPipeline:
        """Build the pipeline from a model folder with its weights on ``device`` in ``dtype`` (a ``torch.dtype``).
        The load plan passes the host when quantization or offload must start there and calls :meth:`place`
        with the execution device afterwards, so ``load`` must not move weights anywhere else."""
        raise NotImplementedError

    def place(self, device: Any, *, move_weights: bool = True) -> None:
        """Make ``device`` the execution device (where latents, generators and scheduler tensors are made), moving
        every component there unless offload hooks bring the weights in per call (``move_weights=False``). The
        load plan calls it last: ``load`` may have read the weights to the host so that quantization or offload
        start there (:mod:`omni_core.optimize.plan`). Override if the pipeline keeps other device tensors."""
        import torch

        from omni_core.optimize.components import components_of

        if move_weights:
            for module in components_of(self).values():
                module.to(device)
        self.device = torch.device(device)

    def prepare_encode(self, state: StepState) -> StepState:
        """Encode prompts, create the initial latents (from ``state.generator``), timesteps and the request's
        own noise scheduler; set ``state.num_steps``."""
        raise NotImplementedError

    def denoise_step(self, states: list[StepState]) -> list[Any]:
        """One denoiser evaluation (CFG branches included) for every state, which may be at different steps.
        Returns one noise prediction per state."""
        raise NotImplementedError

    def step_scheduler(self, state: StepState, noise_pred: Any) -> None:
        """Advance ``state.latents`` with the request's scheduler and increment ``state.step_index``."""
        raise NotImplementedError

    def post_decode(self, state: StepState) -> DiffusionOutput:
        """Decode the final latents into ``DiffusionOutput.tensor`` (float in [0, 1])."""
        raise NotImplementedError

    def denoisers(self) -> list:
        """This pipeline's denoisers as accelerators see them: one
        :class:`~omni_core.pipelines.denoiser.DenoiserSpec` per denoiser module (Wan 2.2: two experts). Cache
        backends and sequence parallelism read only these, so declaring them is all a model does to get every
        cache backend and parallel strategy. Called in the worker after ``load``. Default: none declared."""
        return []

    @classmethod
    def example_prompts(cls) -> list[str]:
        """Prompts this model handles well, for calibration (``omni cache calibrate``) and contract tests."""
        return ["a photo of a cat", "a red car on a street", "a mountain lake at sunrise", "a bowl of fruit",
                "a city skyline at night", "a portrait of an old man", "a forest path in autumn", "a sailing boat"]

    def encoded_prompts(self, states: list[StepState]) -> ContextManager[Any]:
        """A window around the ``prepare_encode`` calls of the requests that start together (a request-mode
        wave, or the new requests of a step wave) in which a pipeline may encode all their prompts in one
        text-encoder call (``DiffusersStepPipeline`` does). Default: nothing shared."""
        return contextlib.nullcontext()

    def post_decode_batch(self, states: list[StepState]) -> list[DiffusionOutput]:
        """``post_decode`` of every state, in order; a pipeline may decode states of one shape together."""
        return [self.post_decode(s) for s in states]

    #: the latent-to-RGB projections this model ships for its previews: a ``"package:file.json"`` resource
    #: ``{"projections": [{"match": {<VAE config key>: value}, "weight": 3 x C, "bias": 3, "source": ...}]}``;
    #: a model folder's own ``preview_projection.json`` (``omni preview calibrate --write``) comes first
    #: (:mod:`omni_core.pipelines.preview`)
    preview_projections: ClassVar[str | None] = None

    def preview(self, state: StepState) -> Any:
        """A cheap RGB preview ``[3, h, w]`` in [0, 1] of the current step (no VAE decode), or None. A video's
        preview is still one ``[3, h, w]`` image (a few frames tiled, same aspect ratio). A pipeline that
        defines ``preview_latents(state)`` gets the projected clean estimate by returning
        ``omni_core.pipelines.preview.render_preview(self, state)``. Default: none."""
        return None

    def forward(self, batch: list[StepState], control: StepControl | None = None) -> list[DiffusionOutput]:
        """Run whole requests. Stopped requests come back ``status="aborted"`` after at most one more step.
        The per-request ends are batched over the wave: prompts inside one :meth:`encoded_prompts` window,
        finished latents through one :meth:`post_decode_batch`."""
        control = control or _NoControl()
        with self.encoded_prompts(batch):
            for state in batch:
                self.prepare_encode(state)
                control.on_encoded(state)
        stopped: set[str] = set()
        while True:
            pending = [s.request_id for s in batch if not s.done and s.request_id not in stopped]
            if pending:
                stopped |= control.stopped(pending)
            active = [s for s in batch if not s.done and s.request_id not in stopped]
            if not active:
                break
            preds = self.denoise_step(active)
            for state, pred in zip(active, preds):
                self.step_scheduler(state, pred)
                control.on_step(state)
        finished = [s for s in batch if s.request_id not in stopped]
        decoded = dict(zip(map(id, finished), self.post_decode_batch(finished))) if finished else {}
        return [decoded[id(s)] if id(s) in decoded else
                DiffusionOutput(request_id=s.request_id, finished=True, status="aborted", step_index=s.step_index,
                                num_steps=s.num_steps) for s in batch]


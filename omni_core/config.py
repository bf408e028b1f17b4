"""Engine configuration and sampling parameters: attrs classes validated when constructed.

Every error is a :class:`~omni_core.errors.ConfigError` naming the field, the value and what is allowed;
``from_kwargs`` rejects unknown keys with a "did you mean" suggestion.
"""

from __future__ import annotations

import math
import numbers
import os
from typing import Any, Callable, Mapping

import attrs

from omni_core.errors import ConfigError, suggest, unknown_choice_message
from omni_core.sampling_fields import SamplingField

DTYPES = ("auto", "float32", "bfloat16", "float16")
OUTPUT_TYPES = ("pil", "pt", "np", "latent")
MAX_OUTPUTS_PER_PROMPT = 16
MAX_INFERENCE_STEPS = 1000
#: guidance scales (guidance_scale, and the ones models declare) must lie in [0, GUIDANCE_MAX]: models
#: are used at 1-20, and a larger scale only amplifies the conditional difference into saturated noise
GUIDANCE_MAX = 100.0
#: hard bounds of one output's height and width, and of num_frames (limits are checked within these)
MAX_SIDE = 16384
MAX_FRAMES = 10000
#: |lora_scale| bound: adapters are used at 0-2; far beyond, the update swamps the base weights
LORA_SCALE_MAX = 10.0
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}


# ------------------------------------------------------------------------------------------ validators
def _where(instance: Any, attribute: attrs.Attribute) -> str:
    return f"{type(instance).__name__}.{attribute.name}"


def _fail(instance: Any, attribute: attrs.Attribute, value: Any, allowed: str) -> None:
    raise ConfigError(f"{_where(instance, attribute)}={value!r} is invalid: {allowed}", field=attribute.name)


def _number_field(kind: type, what: str, min: Any, max: Any, optional: bool, finite: bool = False) -> Callable:
    """One validator for int and float fields: the type (bool refused), finiteness, then ``[min, max]``."""
    def check(instance, attribute, value):
        if value is None and optional:
            return
        if isinstance(value, bool) or not isinstance(value, kind):
            _fail(instance, attribute, value, f"expected {what}{' or None' if optional else ''}, "
                                              f"got {type(value).__name__}")
        if finite and not math.isfinite(value):
            _fail(instance, attribute, value, ("must not be NaN" if value != value else "must be finite") + (
                f" (allowed: {min} to {max})" if min is not None and max is not None else ""))
        if min is not None and value < min:
            _fail(instance, attribute, value, f"must be >= {min}" + (f" and <= {max}" if max is not None else ""))
        if max is not None and value > max:
            _fail(instance, attribute, value, f"must be <= {max}" + (f" and >= {min}" if min is not None else ""))
    return check


def int_field(*, min: int | None = None, max: int | None = None, optional: bool = False) -> Callable:
    return _number_field(numbers.Integral, "an integer", min, max, optional)


def float_field(*, min: float | None = None, max: float | None = None, optional: bool = False) -> Callable:
    """A finite real number in ``[min, max]``: NaN, +-inf and 1e308 are refused (no knob needs them)."""
    return _number_field(numbers.Real, "a number", min, max, optional, finite=True)


def bool_field(instance, attribute, value):
    if not isinstance(value, bool):
        _fail(instance, attribute, value, f"expected True or False, got {type(value).__name__}")


def choice_field(choices: tuple[str, ...], *, optional: bool = False) -> Callable:
    def check(instance, attribute, value):
        if value is None and optional:
            return
        if value not in choices:
            raise ConfigError(f"{_where(instance, attribute)}: " + unknown_choice_message("value", value, choices),
                              field=attribute.name)
    return check


def str_field(*, optional: bool = False) -> Callable:
    def check(instance, attribute, value):
        if value is None and optional:
            return
        if not isinstance(value, str) or not value:
            _fail(instance, attribute, value, "expected a non-empty string")
    return check


def dict_field(instance, attribute, value):
    if not isinstance(value, dict):
        _fail(instance, attribute, value, f"expected a dict, got {type(value).__name__}")


def _dict_or_empty(value: Any) -> Any:
    return {} if value is None else value


class _FromKwargs:
    """``from_kwargs`` for attrs config classes: unknown keys get a 'did you mean' error."""

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in attrs.fields(cls) if f.init]

    @classmethod
    def check_keys(cls, kwargs: Mapping[str, Any]) -> None:
        names = cls.field_names()
        for key in kwargs:
            if key not in names:
                hint = suggest(key, names)
                raise ConfigError(
                    f"{cls.__name__} got an unknown field {key!r}"
                    + (f"; did you mean {hint!r}?" if hint else "")
                    + f" Allowed: {', '.join(sorted(names))}",
                    field=key,
                )

    @classmethod
    def from_kwargs(cls, **kwargs: Any):
        cls.check_keys(kwargs)
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self, recurse=True)


def coerce_record(cls: type, value: Any, *, error: str, field: str, shorthand: str | None = None,
                  none_is_default: bool = True, from_mapping: Callable[[Mapping], Any] | None = None) -> Any:
    """``value`` as a ``cls``: what every config record's ``coerce`` accepts, written once.

    An instance passes through; None gives the defaults (unless ``none_is_default`` is False); a string sets
    the ``shorthand`` field; a mapping goes through ``from_mapping`` (default ``cls.from_kwargs``, which names
    unknown keys). Anything else is a ConfigError ``error.format(value=value)`` on ``field``.
    """
    if value is None and none_is_default:
        return cls()
    if isinstance(value, cls):
        return value
    if shorthand is not None and isinstance(value, str):
        return cls(**{shorthand: value})
    if isinstance(value, Mapping):
        return from_mapping(value) if from_mapping is not None else cls.from_kwargs(**value)
    raise ConfigError(error.format(value=value), field=field)


# ------------------------------------------------------------------------------------------ attention
def _backend_name(instance, attribute, value):
    if not isinstance(value, str) or not value.strip():
        _fail(instance, attribute, value, "expected an attention backend name such as 'TORCH_SDPA'")


@attrs.frozen
class AttentionSpec(_FromKwargs):
    """One backend choice: its name plus backend-specific options passed to the implementation."""

    backend: str = attrs.field(validator=_backend_name)
    options: dict = attrs.field(factory=dict, converter=_dict_or_empty, validator=dict_field)

    @classmethod
    def coerce(cls, value: Any) -> AttentionSpec:
        return coerce_record(cls, value, shorthand="backend", none_is_default=False, field="attention_config",
                             error="attention spec must be a backend name, a dict or AttentionSpec, got {value!r}")


def _coerce_spec_or_none(value: Any) -> AttentionSpec | None:
    return None if value is None else AttentionSpec.coerce(value)


def _coerce_per_role(value: Any) -> dict[str, AttentionSpec]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"AttentionConfig.per_role must map role -> backend, got {value!r}", field="per_role")
    return {str(role): AttentionSpec.coerce(spec) for role, spec in value.items()}


@attrs.frozen
class AttentionConfig(_FromKwargs):
    """Which attention backend each role uses: a global default plus a per-role map.

    Resolution order for a layer with ``role`` and ``role_category``: ``per_role[role]`` ->
    ``per_role[role_category]`` -> ``default`` -> ``OMNI_ATTENTION_BACKEND`` -> the platform's default.
    """

    default: AttentionSpec | None = attrs.field(default=None, converter=_coerce_spec_or_none)
    per_role: dict[str, AttentionSpec] = attrs.field(factory=dict, converter=_coerce_per_role)

    @classmethod
    def coerce(cls, value: Any) -> AttentionConfig:
        return coerce_record(cls, value, shorthand="default", field="attention_config",
                             error="attention_config must be a dict, a backend name or AttentionConfig, got {value!r}")

    def resolve(self, role: str, role_category: str | None = None) -> tuple[AttentionSpec | None, str]:
        """The configured spec for a layer and where it came from (``None`` means: fall through)."""
        if role in self.per_role:
            return self.per_role[role], f"per_role[{role!r}]"
        if role_category is not None and role_category in self.per_role:
            return self.per_role[role_category], f"per_role[{role_category!r}] (role category)"
        if self.default is not None:
            return self.default, "attention_config.default"
        env = os.environ.get("OMNI_ATTENTION_BACKEND", "").strip()
        if env:
            return AttentionSpec(backend=env), "OMNI_ATTENTION_BACKEND"
        return None, "platform default"

    def backend_names(self) -> set[str]:
        names = {s.backend for s in self.per_role.values()}
        if self.default is not None:
            names.add(self.default.backend)
        return names


# ------------------------------------------------------------------------------------------ parallel
PARALLEL_STRATEGIES = ("ulysses", "ring", "cfg", "data")


@attrs.frozen
class ParallelConfig(_FromKwargs):
    """Degrees of each parallel strategy; their product is the number of worker processes.

    Ranks are laid out tp-sp-pp-cfg-dp (sequence parallel = ulysses x ring).
    """

    ulysses_degree: int = attrs.field(default=1, validator=int_field(min=1))
    ring_degree: int = attrs.field(default=1, validator=int_field(min=1))
    cfg_parallel_size: int = attrs.field(default=1, validator=int_field(min=1, max=2))
    data_parallel_size: int = attrs.field(default=1, validator=int_field(min=1))
    tensor_parallel_size: int = attrs.field(default=1, validator=int_field(min=1, max=1))
    pipeline_parallel_size: int = attrs.field(default=1, validator=int_field(min=1, max=1))

    @classmethod
    def coerce(cls, value: Any) -> ParallelConfig:
        return coerce_record(cls, value, field="parallel_config",
                             error="parallel_config must be a dict or ParallelConfig, got {value!r}")

    @property
    def sequence_parallel_size(self) -> int:
        return self.ulysses_degree * self.ring_degree

    @property
    def world_size(self) -> int:
        return (self.tensor_parallel_size * self.sequence_parallel_size * self.pipeline_parallel_size
                * self.cfg_parallel_size * self.data_parallel_size)

    #: rank layout, fastest-varying first (within sp: ulysses inner, ring outer)
    RANK_ORDER = "tp-sp-pp-cfg-dp"

    def describe_world(self) -> str:
        """``"ulysses 2 x ring 2 x cfg 2 = 8"``: how the world size is made up (for error messages)."""
        parts = [f"{name} {size}" for name, size in (
            ("tp", self.tensor_parallel_size), ("ulysses", self.ulysses_degree), ("ring", self.ring_degree),
            ("pp", self.pipeline_parallel_size), ("cfg", self.cfg_parallel_size), ("dp", self.data_parallel_size))
            if size > 1]
        return f"{' x '.join(parts) or 'no parallelism'} = {self.world_size} process(es)"

    def check(self, world_size: int | None = None, *, num_heads: int | None = None,
              num_kv_heads: int | None = None, supported: tuple[str, ...] | list[str] | None = None,
              model: str = "the model") -> ParallelConfig:
        """Check the degrees against the number of processes, the denoiser's attention heads and the
        strategies a pipeline supports; raise :class:`ConfigError` naming the field. Returns ``self``."""
        if world_size is not None and world_size != self.world_size:
            raise ConfigError(
                f"parallel_config needs {self.describe_world()} but the world size is {world_size}; make the "
                f"product of ulysses_degree, ring_degree, cfg_parallel_size, data_parallel_size (x tp x pp) "
                f"equal the number of worker processes", field="parallel_config")
        for heads, what in ((num_heads, "attention heads"), (num_kv_heads, "key/value heads")):
            if heads is not None and self.ulysses_degree > 1 and heads % self.ulysses_degree:
                ok = [d for d in range(1, heads + 1) if heads % d == 0]
                raise ConfigError(
                    f"ParallelConfig.ulysses_degree={self.ulysses_degree} is invalid: Ulysses splits the "
                    f"{heads} {what} of {model} across ranks, so the degree must divide {heads} "
                    f"(allowed: {', '.join(map(str, ok))}); use ring_degree for the rest", field="ulysses_degree")
        if supported is not None:
            fields = {"ulysses": "ulysses_degree", "ring": "ring_degree", "cfg": "cfg_parallel_size",
                      "data": "data_parallel_size"}
            for strategy in self.requested_strategies():
                if strategy not in supported:
                    raise ConfigError(
                        f"ParallelConfig.{fields[strategy]}={getattr(self, fields[strategy])} is invalid: "
                        f"{model} does not support {strategy} parallelism (supported: "
                        f"{', '.join(supported) or 'none'})", field=fields[strategy])
        return self

    def requested_strategies(self) -> list[str]:
        """Strategy names (as pipelines declare them) that this config turns on."""
        out = []
        if self.ulysses_degree > 1:
            out.append("ulysses")
        if self.ring_degree > 1:
            out.append("ring")
        if self.cfg_parallel_size > 1:
            out.append("cfg")
        if self.data_parallel_size > 1:
            out.append("data")
        return out


# ------------------------------------------------------------------------------------------ limits
#: RequestLimits field -> (what it bounds, the SamplingParams field an error names, ``omni serve`` flag)
LIMIT_FIELDS = {
    "max_pixels": ("height x width of one output", "size", "--max-pixels"),
    "max_frames": ("num_frames", "num_frames", "--max-frames"),
    "max_steps": ("num_inference_steps", "num_inference_steps", "--max-steps"),
    "max_outputs": ("num_outputs_per_prompt (the server's n)", "num_outputs_per_prompt", "--max-outputs"),
    "max_prompt_chars": ("characters of the prompt and of the negative prompt, each", "prompt", "--max-prompt-chars"),
    "max_image_pixels": ("height x width of each input image (edit and image-to-video models)", "image",
                         "--max-image-pixels"),
}


@attrs.frozen
class RequestLimits(_FromKwargs):
    """The most one request may ask for, so no single request can hold the engine for long.

    ``None`` means "the model's default" (``OmniPipeline.request_limits``); the engine checks every request
    against the resolved limits before any work starts. ``SamplingParams``' own bounds still apply.
    """

    max_pixels: int | None = attrs.field(default=None, validator=int_field(min=1, max=MAX_SIDE * MAX_SIDE,
                                                                          optional=True))
    max_frames: int | None = attrs.field(default=None, validator=int_field(min=1, max=MAX_FRAMES, optional=True))
    max_steps: int | None = attrs.field(default=None, validator=int_field(min=1, max=MAX_INFERENCE_STEPS,
                                                                         optional=True))
    max_outputs: int | None = attrs.field(default=None, validator=int_field(min=1, max=MAX_OUTPUTS_PER_PROMPT,
                                                                           optional=True))
    max_prompt_chars: int | None = attrs.field(default=None, validator=int_field(min=1, optional=True))
    max_image_pixels: int | None = attrs.field(default=None, validator=int_field(min=1, optional=True))

    @classmethod
    def coerce(cls, value: Any) -> RequestLimits:
        return coerce_record(cls, value, field="limits",
                             error="limits must be a dict such as {{'max_steps': 200}} or RequestLimits, got "
                                   "{value!r}; fields: " + ", ".join(LIMIT_FIELDS))

    def resolved(self, defaults: Mapping[str, int]) -> RequestLimits:
        """These limits with every ``None`` replaced by ``defaults`` (which must cover every field)."""
        return attrs.evolve(self, **{name: defaults[name] for name in LIMIT_FIELDS if getattr(self, name) is None})

    def check(self, params: SamplingParams, prompt: str | None = None, negative_prompt: str | None = None,
              *, model: str = "the model") -> None:
        """Refuse a request (complete params) that asks for more than a limit, naming the field and the limit."""
        def refuse(name: str, what: str, field: str | None = None) -> None:
            limit = getattr(self, name)
            raise ConfigError(f"{what} exceeds {name}={limit} for {model}; raise it with "
                              f"limits={{{name!r}: ...}} (omni serve {LIMIT_FIELDS[name][2]})",
                              field=field or LIMIT_FIELDS[name][1])

        if self.max_pixels is not None and params.height is not None and params.width is not None:
            pixels = params.height * params.width
            if pixels > self.max_pixels:
                refuse("max_pixels", f"height x width = {params.height}x{params.width} = {pixels} pixels")
        checks = (("max_frames", "num_frames"), ("max_steps", "num_inference_steps"),
                  ("max_outputs", "num_outputs_per_prompt"))
        for name, field in checks:
            value = getattr(params, field)
            if getattr(self, name) is not None and value is not None and value > getattr(self, name):
                refuse(name, f"{field}={value}")
        for text, field in ((prompt, "prompt"), (negative_prompt, "negative_prompt")):
            if self.max_prompt_chars is not None and text is not None and len(text) > self.max_prompt_chars:
                refuse("max_prompt_chars", f"{field} of {len(text)} characters", field)


# ------------------------------------------------------------------------------------------ engine
def _normalise_dtype(value: Any) -> Any:
    if isinstance(value, str):
        return _DTYPE_ALIASES.get(value.lower(), value.lower())
    name = getattr(value, "__repr__", lambda: "")()
    if name.startswith("torch."):  # a torch.dtype, without importing torch here
        return _DTYPE_ALIASES.get(name[6:], name[6:])
    return value


def _check_registered(kind: str, name: str, where: str, field: str) -> None:
    """``ConfigError`` (naming ``where``, the allowed names and the closest one) unless ``name`` is registered."""
    from omni_core.errors import UnknownComponentError
    from omni_core.plugins.manager import get_plugin_manager

    try:
        get_plugin_manager().get_component(kind, name)
    except UnknownComponentError as exc:
        raise ConfigError(f"{where}: {exc}", field=field) from None


def _component_name(kind: str, *, optional: bool = False) -> Callable:
    """Validate a component name against the plugin registry (loaded on first use)."""

    def check(instance, attribute, value):
        if value is None and optional:
            return
        if not isinstance(value, str) or not value:
            _fail(instance, attribute, value, f"expected the name of a registered {kind} component")
        _check_registered(kind, value, _where(instance, attribute), attribute.name)

    return check


QUANTIZATION_METHODS = ("int8", "fp8", "none")
OFFLOAD_MODES = ("model", "group", "none")
PERFORMANCE_MODES = ("speed", "memory", "auto")


def _names_tuple(value: Any) -> Any:
    if isinstance(value, str):
        return tuple(v.strip() for v in value.split(",") if v.strip())
    return tuple(value) if isinstance(value, (list, tuple)) else value


def _non_empty_names(instance, attribute, value):
    if not isinstance(value, tuple) or not value or not all(isinstance(v, str) and v for v in value):
        _fail(instance, attribute, value, "expected component names, e.g. ('denoiser',) or ('denoiser', "
                                          "'text_encoder')")


def _path_or_none(value: Any) -> Any:
    return os.fspath(value) if isinstance(value, os.PathLike) else value


def _tiny_decoder_folder(instance, attribute, value):
    """``preview_decoder``: None, or a folder whose config.json names ``AutoencoderTiny`` (checked before any
    model loads)."""
    if value is None:
        return
    str_field()(instance, attribute, value)
    import json

    path = os.path.join(value, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            name = json.load(f).get("_class_name")
    except (OSError, ValueError, AttributeError) as exc:
        _fail(instance, attribute, value, f"a folder with a diffusers AutoencoderTiny (config.json; {exc})")
    if name != "AutoencoderTiny":
        _fail(instance, attribute, value, f"a folder with a diffusers AutoencoderTiny; its config.json names {name!r}")


def _optional_bool(instance, attribute, value):
    if value is not None:
        bool_field(instance, attribute, value)


def _bool_or_dict(instance, attribute, value):
    if value is not None and not isinstance(value, (bool, dict)):
        _fail(instance, attribute, value, "expected True, False or a dict of enable_tiling arguments")


@attrs.frozen
class OmniDiffusionConfig(_FromKwargs):
    """Everything the engine needs to start: model, device, parallelism, kernels, caching, batching."""

    model: str = attrs.field(validator=str_field())
    dtype: str = attrs.field(default="auto", converter=_normalise_dtype, validator=choice_field(DTYPES))
    #: platform name (``cpu``, ``cuda``, ...); None resolves it (``OMNI_PLATFORM``, detection, CPU fallback)
    platform: str | None = attrs.field(default=None, validator=_component_name("platform", optional=True))
    parallel_config: ParallelConfig = attrs.field(factory=ParallelConfig, converter=ParallelConfig.coerce)
    attention_config: AttentionConfig = attrs.field(factory=AttentionConfig, converter=AttentionConfig.coerce)
    cache_backend: str = attrs.field(default="none", validator=_component_name("cache"))
    cache_config: dict = attrs.field(factory=dict, converter=_dict_or_empty, validator=dict_field)
    #: capacity of one wave: how many compatible requests run together; None (default) batches by default: up to
    #: 8 requests within a pixel budget (omni_core/sched/capacity.py); 1 turns batching off
    max_num_seqs: int | None = attrs.field(default=None, validator=int_field(min=1, max=1024, optional=True))
    step_execution: bool = attrs.field(default=False, validator=bool_field)
    streaming_output: bool = attrs.field(default=False, validator=bool_field)
    #: executor name; None picks ``uni`` for one process and ``mp`` for several
    executor: str | None = attrs.field(default=None, validator=_component_name("executor", optional=True))
    #: scheduler name; None picks ``step`` in step mode and ``request`` otherwise
    scheduler: str | None = attrs.field(default=None, validator=_component_name("scheduler", optional=True))
    #: waiting requests beyond this are refused (None = unbounded)
    max_waiting_requests: int | None = attrs.field(default=None, validator=int_field(min=1, optional=True))
    warmup: bool = attrs.field(default=True, validator=bool_field)
    #: extra keyword arguments for the pipeline's ``from_pretrained``
    model_kwargs: dict = attrs.field(factory=dict, converter=_dict_or_empty, validator=dict_field)
    #: seconds to wait for worker processes to load the model
    worker_start_timeout: float = attrs.field(default=300.0, validator=float_field(min=1.0))
    #: the most one request may ask for; None fields take the model's defaults (``engine.limits``)
    limits: RequestLimits = attrs.field(factory=RequestLimits, converter=RequestLimits.coerce)
    #: start more worker processes than the platform has devices (or usable CPU cores) anyway
    oversubscribe: bool = attrs.field(default=False, validator=bool_field)
    #: torch threads of each model process, set once at its start; None = this machine's usable CPU cores
    #: divided by the model processes on it (``omni_core.platforms.threads``)
    cpu_threads: int | None = attrs.field(default=None, validator=int_field(min=1, max=4096, optional=True))
    #: step mode: how many times one request may be preempted by more urgent ones (0: priority without
    #: preemption); bounds the delay preemption can add to a request (docs/scheduling.md)
    max_preemptions: int = attrs.field(default=4, validator=int_field(min=0, max=1000))
    #: seconds one wave's step may take: the scheduler learns each shape's per-step cost online and caps a wave
    #: to fit (None: no cap, waves are limited by max_num_seqs only; docs/scheduling.md)
    step_time_budget_s: float | None = attrs.field(default=None, validator=float_field(min=1e-4, max=3600.0,
                                                                                       optional=True))
    #: LoRA adapters preloaded by name (``{"name": "path/to/adapter.safetensors"}``; see docs/lora.md)
    loras: dict = attrs.field(factory=dict, converter=_dict_or_empty, validator=dict_field)
    #: the most LoRA adapters kept loaded in each worker (an LRU cache; adapters in use are never evicted)
    max_loras: int = attrs.field(default=8, validator=int_field(min=1, max=1024))
    #: the largest LoRA rank accepted (a request naming a larger adapter is refused)
    max_lora_rank: int = attrs.field(default=64, validator=int_field(min=1, max=4096))
    #: options of the selected executor (its class's ``options``); ``from_kwargs`` collects ``<executor>_<name>=``
    #: keywords here, e.g. ``Omni(model, executor="ray", ray_address="auto")`` -> ``{"address": "auto"}``
    executor_options: dict = attrs.field(factory=dict, converter=_dict_or_empty, validator=dict_field)
    # -- memory and speed options (omni_core.optimize; docs/memory.md). None = unset: a performance_mode preset
    # may fill it; "none" / False say "off" explicitly and a preset keeps them
    #: weight-only quantization of ``quantize_components``: "int8" or "fp8" (torchao), "none"
    quantization: str | None = attrs.field(default=None, validator=choice_field(QUANTIZATION_METHODS, optional=True))
    #: components to quantize; "denoiser" = every denoiser the model declares (add "text_encoder" to shrink it too)
    quantize_components: tuple = attrs.field(default=("denoiser",), converter=_names_tuple,
                                             validator=_non_empty_names)
    #: a GGUF file with the denoiser's weights (loaded by diffusers' GGUF support; diffusers-folder models)
    denoiser_weights: str | None = attrs.field(default=None, converter=_path_or_none, validator=str_field(optional=True))
    #: "model" (whole components just in time), "group" (blocks, prefetched on a side stream), "none"
    offload: str | None = attrs.field(default=None, validator=choice_field(OFFLOAD_MODES, optional=True))
    #: VAE tiled decode/encode: True, or a dict of the VAE's ``enable_tiling`` arguments (tile sizes)
    vae_tiling: Any = attrs.field(default=None, validator=_bool_or_dict)
    #: VAE decode one sample at a time
    vae_slicing: bool | None = attrs.field(default=None, validator=_optional_bool)
    #: regional torch.compile of the denoisers' repeated blocks (dynamic shapes)
    compile: bool | None = attrs.field(default=None, validator=_optional_bool)
    #: "speed", "memory" or "auto": fill the unset options above from the model size and free memory
    performance_mode: str | None = attrs.field(default=None, validator=choice_field(PERFORMANCE_MODES, optional=True))
    #: a folder holding a diffusers ``AutoencoderTiny`` (TAESD-style) for the model's latents: streamed previews
    #: decode through it instead of the latent-to-RGB projection (docs/previews.md)
    preview_decoder: str | None = attrs.field(default=None, converter=_path_or_none, validator=_tiny_decoder_folder)

    def __attrs_post_init__(self) -> None:
        for name in sorted(self.attention_config.backend_names()):
            _check_registered("attention", name, "OmniDiffusionConfig.attention_config", "attention_config")
        if self.executor_options:
            _check_executor_options(self.executor_name, self.executor_options)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> OmniDiffusionConfig:
        """Build from flat keyword arguments; ``attention_backend="X"`` is shorthand for the default backend."""
        kwargs = dict(kwargs)
        backend = kwargs.pop("attention_backend", None)
        if backend is not None:
            att = AttentionConfig.coerce(kwargs.get("attention_config"))
            kwargs["attention_config"] = attrs.evolve(att, default=backend)
        _collect_executor_options(kwargs, cls.field_names())
        cls.check_keys(kwargs)
        return cls(**kwargs)

    @classmethod
    def field_names(cls) -> list[str]:
        return [*super().field_names(), "attention_backend"]

    @property
    def world_size(self) -> int:
        return self.parallel_config.world_size

    @property
    def uses_step_execution(self) -> bool:
        """Streaming output forces step execution."""
        return self.step_execution or self.streaming_output

    @property
    def executor_name(self) -> str:
        if self.executor is not None:
            return self.executor
        return "mp" if self.world_size > 1 else "uni"

    @property
    def scheduler_name(self) -> str:
        if self.scheduler is not None:
            return self.scheduler
        return "step" if self.uses_step_execution else "request"


def executor_option_names() -> dict[str, dict[str, str]]:
    """``{executor: {option: help}}`` of every registered executor that declares options (imports their classes,
    which must stay light: an executor imports its heavy libraries in ``start``)."""
    from omni_core.plugins.manager import get_plugin_manager

    pm = get_plugin_manager()
    out = {}
    for name in sorted(pm.components("executor")):
        try:
            options = getattr(pm.load_component("executor", name), "options", None) or {}
        except Exception:  # noqa: BLE001 - an unusable executor has no options to offer
            continue
        if options:
            out[name] = dict(options)
    return out


def _collect_executor_options(kwargs: dict, fields: list[str]) -> None:
    """Move ``<executor>_<name>`` keywords of the selected executor into ``executor_options`` (in place); a known
    option of another executor is an error naming the executor it belongs to."""
    if not any(key not in fields and "_" in key for key in kwargs):
        return
    executor = kwargs.get("executor")
    declared = executor_option_names()
    collected = dict(kwargs.get("executor_options") or {})
    for key in [k for k in kwargs if k not in fields]:
        for name, options in declared.items():
            prefix = f"{name}_"
            if key.startswith(prefix) and key[len(prefix):] in options:
                if executor != name:
                    raise ConfigError(f"{key} is an option of executor {name!r}; pass executor={name!r} "
                                      f"(omni serve --executor {name}) to use it", field=key)
                collected[key[len(prefix):]] = kwargs.pop(key)
    if collected:
        kwargs["executor_options"] = collected


def _check_executor_options(executor: str, options: dict) -> None:
    """Every key of ``executor_options`` must be an option the executor declares."""
    from omni_core.plugins.manager import get_plugin_manager

    cls = get_plugin_manager().load_component("executor", executor)
    declared = getattr(cls, "options", None) or {}
    for key in options:
        if key not in declared:
            allowed = ", ".join(f"{executor}_{n}" for n in declared) or "none"
            raise ConfigError(f"executor {executor!r} has no option {key!r}; its options: {allowed}",
                              field="executor_options")
    check = getattr(cls, "check_options", None)  # the executor's own checks of the values
    if check is not None:
        check(dict(options))


# ------------------------------------------------------------------------------------------ sampling
def registered_sampling_fields() -> dict[str, list[tuple[str, SamplingField]]]:
    """``{field name: [(pipeline, declaration), ...]}`` of every registered pipeline's ``sampling_fields``, read
    from the plugin manager's records (no pipeline is imported)."""
    from omni_core.plugins.manager import get_plugin_manager

    out: dict[str, list[tuple[str, SamplingField]]] = {}
    for name, spec in sorted(get_plugin_manager().components("pipeline").items()):
        for field in getattr(spec, "sampling_fields", ()):
            out.setdefault(field.name, []).append((name, field))
    return out


def _field_validator(field: SamplingField) -> Callable:
    if field.type == "float":
        return float_field(min=field.min, max=field.max)
    if field.type == "int":
        return int_field(min=field.min, max=field.max)
    if field.type == "bool":
        return bool_field
    if field.type == "choice":
        return choice_field(field.choices)
    return str_field()


def check_sampling_field(instance: Any, field: SamplingField, value: Any) -> None:
    """Validate ``value`` (not None) against a model's declaration with the core fields' own validators, so the
    message reads like theirs: ``SamplingParams.shift_scale=nan is invalid: must not be NaN``."""
    _field_validator(field)(instance, field, value)


def _check_model_fields(instance: SamplingParams, attribute: attrs.Attribute, values: dict) -> None:
    """Each model field must be declared by some registered pipeline and valid for (one of) its declarations;
    once the pipeline's ``check_sampling_params`` has set ``model_field_specs``, only its own declarations count."""
    if not isinstance(values, dict):
        _fail(instance, attribute, values, f"expected a dict, got {type(values).__name__}")
    if not values:
        return
    own = {f.name: [("", f)] for f in instance.model_field_specs}  # after the pipeline's check: its declarations
    declared = {**registered_sampling_fields(), **own} if set(values) - set(own) else own
    for name, value in values.items():
        if name not in declared:
            type(instance).check_keys({name: value})  # the unknown-field error, naming what is allowed
        error = None
        for _, field in declared[name]:
            try:
                check_sampling_field(instance, field, value)
                break
            except ConfigError as exc:
                error = error or exc
        else:
            raise error


@attrs.frozen(init=False)
class SamplingParams(_FromKwargs):
    """Prompt-independent generation knobs. ``None`` means "the model's default".

    Besides the core fields below, a keyword may name a sampling field a registered model declares (see
    :mod:`omni_core.sampling_fields`, e.g. a model's ``shift_scale``): it is validated against that
    declaration, stored in ``model_fields`` and read back as an attribute (``params.shift_scale``; a
    declared field that is unset reads None until the pipeline's check fills its default). They live beside
    ``extra_args``, not in it: they are typed and checked when the params are built, named like core fields
    in errors, CLI flags and HTTP bodies, and may key batches; ``extra_args`` stays the free-form options the
    pipeline alone reads.
    """

    height: int | None = attrs.field(default=None, validator=int_field(min=1, max=MAX_SIDE, optional=True))
    width: int | None = attrs.field(default=None, validator=int_field(min=1, max=MAX_SIDE, optional=True))
    num_frames: int | None = attrs.field(default=None, validator=int_field(min=1, max=MAX_FRAMES, optional=True))
    num_inference_steps: int | None = attrs.field(
        default=None, validator=int_field(min=1, max=MAX_INFERENCE_STEPS, optional=True))
    guidance_scale: float | None = attrs.field(default=None, validator=float_field(
        min=0.0, max=GUIDANCE_MAX, optional=True))
    seed: int | None = attrs.field(default=None, validator=int_field(min=0, max=2**63 - 1, optional=True))
    num_outputs_per_prompt: int = attrs.field(default=1, validator=int_field(min=1, max=MAX_OUTPUTS_PER_PROMPT))
    output_type: str = attrs.field(default="pil", validator=choice_field(OUTPUT_TYPES))
    max_sequence_length: int | None = attrs.field(default=None, validator=int_field(min=1, max=8192, optional=True))
    #: a LoRA adapter: a name from the engine's ``loras`` or a path to a .safetensors file (docs/lora.md)
    lora: str | None = attrs.field(default=None, validator=str_field(optional=True))
    #: how strongly the adapter applies (its update times this; 0 = the base model)
    lora_scale: float = attrs.field(default=1.0, validator=float_field(min=-LORA_SCALE_MAX, max=LORA_SCALE_MAX))
    #: model-specific options, checked by the pipeline
    extra_args: dict = attrs.field(factory=dict, converter=_dict_or_empty, validator=dict_field)
    #: values of model-declared sampling fields by name (None values are left out: unset means the default)
    model_fields: dict = attrs.field(factory=dict, converter=_dict_or_empty, validator=_check_model_fields)
    #: the declarations of the pipeline whose ``check_sampling_params`` produced these params (empty before):
    #: the schedulers key batches on those with ``splits_batch``
    model_field_specs: tuple = attrs.field(default=(), converter=tuple, eq=False)  # bookkeeping, not a value
    #: scheduling priority: lower runs first (as in vLLM); equal priorities run in arrival order (docs/scheduling.md)
    priority: int = attrs.field(default=0, validator=int_field(min=-(2**31), max=2**31 - 1))
    #: seconds from admission after which an unfinished request is aborted with a timeout error (None: no deadline)
    timeout: float | None = attrs.field(default=None, validator=float_field(min=0.001, max=7 * 86400.0, optional=True))

    #: fields set by the core or the pipeline's check, not by callers
    _INTERNAL = ("model_fields", "model_field_specs")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        core = {a.name for a in attrs.fields(type(self))}
        values = dict(kwargs.pop("model_fields", None) or {})
        for name in [k for k in kwargs if k not in core]:
            value = kwargs.pop(name)
            if value is None:
                values.pop(name, None)
            else:
                values[name] = value
        self.__attrs_init__(*args, model_fields=values, **kwargs)

    def __getattr__(self, name: str) -> Any:
        """A model field as an attribute: its value, else None when some pipeline declares it."""
        if name.startswith("_") or name in self._INTERNAL:
            raise AttributeError(name)
        values = self.model_fields
        if name in values:
            return values[name]
        if any(f.name == name for f in self.model_field_specs) or name in registered_sampling_fields():
            return None
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @classmethod
    def field_names(cls) -> list[str]:
        core = [n for n in super().field_names() if n not in cls._INTERNAL]
        return [*core, *(n for n in registered_sampling_fields() if n not in core)]

    def replace(self, **changes: Any) -> SamplingParams:
        self.check_keys(changes)
        return attrs.evolve(self, **changes)

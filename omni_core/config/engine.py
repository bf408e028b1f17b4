"""``OmniDiffusionConfig``: everything the engine needs to start, validated when constructed."""

from __future__ import annotations

import os
from typing import Any, Callable

import attrs

from omni_core.config.attention import AttentionConfig
from omni_core.config.bounds import _DTYPE_ALIASES, DTYPES
from omni_core.config.limits import RequestLimits
from omni_core.config.parallel import ParallelConfig
from omni_core.config.plugin_options import (_check_cache_options, _check_executor_options,
                                             _collect_executor_options)
from omni_core.config.validators import (_dict_or_empty, _fail, _FromKwargs, _where, bool_field, choice_field,
                                         dict_field, float_field, int_field, str_field)
from omni_core.errors import ConfigError


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


def _stage_device(value: Any) -> Any:
    return "auto" if value is None else str(value).strip().lower()


def _check_stage_device(instance, attribute, value):
    """``encode_device`` / ``decode_device``: "auto", "cpu" or a device index (0, 1, ... or "cuda:1")."""
    index = value.rpartition(":")[2] if ":" in value else value
    if value not in ("auto", "cpu") and not index.isdigit():
        raise ConfigError(f"{attribute.name} must be 'auto' (the model's first device), 'cpu' or a device index "
                          f"such as 1 or 'cuda:1', got {value!r}", field=attribute.name)


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
    #: the pipeline (a registered name) that runs ``model``; None: the folder's ``model_index.json`` class, else
    #: the installed pipeline that serves any folder (``pipeline="diffusers"`` forces diffusers' own pipeline)
    pipeline: str | None = attrs.field(default=None, validator=_component_name("pipeline", optional=True))
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
    #: every request computes exactly what it computes alone, whatever shares its wave: its text encoding, each
    #: denoiser call and its decode run on its own rows only (``omni_core.worker.batch_invariant``); waves still
    #: interleave requests step by step. Costs the throughput of folding requests into one call (docs/rollouts.md)
    batch_invariant: bool = attrs.field(default=False, validator=bool_field)
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
    #: bytes of text-encoder outputs each model process keeps (an LRU shared by all requests: a prompt seen
    #: before skips the text encoder; 0 turns it off; docs/runtime.md "Embedding cache")
    embedding_cache_bytes: int = attrs.field(default=256 * 1024 * 1024, validator=int_field(min=0, max=2**44))
    #: processes that run the VAE decode apart from the denoiser (0: decoded in line, in the model process; 1: one
    #: decode process holds the decode components and the denoiser starts its next wave meanwhile; docs/runtime.md
    #: "Stages")
    decode_workers: int = attrs.field(default=0, validator=int_field(min=0, max=1))
    #: processes that run the text encoders apart (0: in the model process; 1: one encode process encodes each
    #: request's texts as it arrives, before it is queued, and the model process loads no text encoder)
    encode_workers: int = attrs.field(default=0, validator=int_field(min=0, max=1))
    #: where the encode / decode process runs: "auto" (the model's first device), "cpu", or a device index
    encode_device: str = attrs.field(default="auto", converter=_stage_device, validator=_check_stage_device)
    decode_device: str = attrs.field(default="auto", converter=_stage_device, validator=_check_stage_device)
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
        if self.cache_config:
            _check_cache_options(self.cache_backend, self.cache_config)

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

"""Sequence-parallel plans: a model declares where its tokens are sharded and gathered; hooks do the rest.

A pipeline opts in without touching its denoiser's forward, by declaring the plan in the denoiser's
:class:`~omni_core.pipelines.denoiser.DenoiserSpec`::

    DenoiserSpec(name="transformer", module=dit, ..., num_heads=24, sp_plan={
        "shard_after": {"x_embedder": 1, "rope": {0: 0, 1: 0}},   # outputs to shard (tokens on dim 1 / 0)
        "gather_before": "final_layer",                          # gather the input of this submodule
        "joint_text": "encoder_hidden_states",                  # text tokens replicated in joint attention
    })

and every worker installs it after ``init_parallel_state`` and ``load``
(:func:`apply_sequence_parallel_to_pipeline`, called by ``load_pipeline``); code that shards a bare module
calls ``apply_sequence_parallel(module, plan)`` itself (hooks are a no-op while the sp group has one rank)

or, for a model whose forward already takes tokens, ``{"shard": {"hidden_states": 1, "rotary_emb": 0},
"gather": 1}``; for one that builds its token sequence inline (Wan: conv, flatten, transpose), shard the
arguments of the first block and gather the output of the last projection:
``{"shard_before": {"blocks.0": {"hidden_states": 1}}, "shard_after": {"rope": {0: 1, 1: 1}},
"gather_after": "proj_out", "gather": None}``. During each forward of the module: the declared
inputs/outputs are split along their token dimension (padded to a multiple of the sp size), ``Attention``
layers inside run the sequence-parallel strategy chosen from the ulysses/ring groups, and the output is
all-gathered with the padding stripped.
Everything per-token (rotary tables, positional embeddings, per-token masks) must be named in the plan so
that it is sharded the same way as the tokens. In ``shard_before`` an argument may be a tuple of tensors (a
rotary ``(cos, sin)``: each is sharded), and one whose length along its token dim is 1 while the region's
tokens are more (a per-row modulation that other calls give per token, as LTX-2's ``temb`` in image-to-video)
broadcasts over the tokens: every rank keeps it whole. The first argument named fixes the token count.
"""

from __future__ import annotations

import inspect
import re
from typing import Any, Callable, Mapping

import attrs
import torch
from torch import nn

from omni_core.attention.parallel.region import SIDES, SPRegion, current_region
from omni_core.attention.parallel.strategies import build_sequence_parallel_attention
from omni_core.config import coerce_record
from omni_core.errors import ConfigError, suggest
from omni_core.forward_context import use_forward_context



def _dims(value: Any, what: str) -> dict[str, Any]:
    if value is None:
        return {}
    if isinstance(value, str):
        return {value: 1}
    if isinstance(value, (list, tuple)):
        return {name: 1 for name in value}
    if isinstance(value, Mapping):
        return dict(value)
    raise ConfigError(f"SequenceParallelPlan.{what} must map names to token dims, got {value!r}", field=what)


@attrs.frozen
class SequenceParallelPlan:
    """Where a module's tokens are sharded and gathered (see the module docstring)."""

    #: forward arguments of the module -> their token dimension
    shard_inputs: dict = attrs.field(factory=dict, converter=lambda v: _dims(v, "shard_inputs"))
    #: submodule path -> token dim of its output, or {output index: dim} for tuple outputs
    shard_outputs: dict = attrs.field(factory=dict, converter=lambda v: _dims(v, "shard_outputs"))
    #: token dim of the module's output to gather at the end (None: gathered elsewhere or not at all)
    gather_output: int | None = 1
    #: which element of a tuple output holds the tokens
    gather_output_index: int = 0
    #: submodule path -> token dim of its first positional argument, gathered before it runs
    gather_before: dict = attrs.field(factory=dict, converter=lambda v: _dims(v, "gather_before"))
    #: submodule path -> {argument name: token dim}: shard those arguments when the submodule first runs
    #: (for models that build the token sequence inline, e.g. Wan: ``{"blocks.0": {"hidden_states": 1}}``); ``*``
    #: matches one path segment, so ``{"blocks.*": {...}}`` shards per-token side inputs that the model's forward
    #: hands every block afresh (LTX-2's rotary tables), each block's own call once per forward
    shard_before: dict = attrs.field(factory=dict, converter=lambda v: _dims(v, "shard_before"))
    #: submodule path -> token dim of its output (a tensor or a tuple's first element), gathered after it runs
    gather_after: dict = attrs.field(factory=dict, converter=lambda v: _dims(v, "gather_after"))
    #: forward argument whose length along ``joint_text_dim`` is the replicated text length of joint attention
    joint_text_input: str | None = None
    joint_text_dim: int = 1
    joint_text_side: str = attrs.field(default="front", validator=attrs.validators.in_(SIDES))
    #: inputs every rank keeps whole (documentation; e.g. the text embeddings)
    replicate: tuple = attrs.field(default=(), converter=tuple)

    _ALIASES = {"shard": "shard_inputs", "shard_after": "shard_outputs", "gather": "gather_output",
                "joint_text": "joint_text_input"}

    @classmethod
    def coerce(cls, value: Any) -> SequenceParallelPlan:
        """A plan from a ``SequenceParallelPlan`` or a dict (keys: field names or ``shard``, ``shard_after``,
        ``gather``, ``joint_text``)."""
        return coerce_record(cls, value, none_is_default=False, from_mapping=cls._from_mapping, field="_sp_plan",
                             error="a sequence-parallel plan must be a dict or SequenceParallelPlan, got {value!r}")

    @classmethod
    def _from_mapping(cls, value: Mapping) -> SequenceParallelPlan:
        names = [f.name for f in attrs.fields(cls)]
        kwargs = {}
        for key, val in value.items():
            field = cls._ALIASES.get(key, key)
            if field not in names:
                hint = suggest(key, [*names, *cls._ALIASES])
                raise ConfigError(f"unknown sequence-parallel plan key {key!r}"
                                  + (f"; did you mean {hint!r}?" if hint else "")
                                  + f" Allowed: {', '.join(sorted([*names, *cls._ALIASES]))}", field=key)
            kwargs[field] = val
        return cls(**kwargs)


def _map_tokens(value: Any, spec: Any, fn: Callable[[torch.Tensor, int], torch.Tensor]) -> Any:
    """Apply ``fn(tensor, dim)`` to a tensor output (``spec`` an int) or to chosen tuple elements."""
    if isinstance(spec, int):
        return fn(value, spec) if isinstance(value, torch.Tensor) else value
    items = list(value)
    for index, dim in spec.items():
        if items[index] is not None:
            items[index] = fn(items[index], dim)
    return type(value)(items) if isinstance(value, tuple) else items


class SequenceParallelHandle:
    """Hooks installed by :func:`apply_sequence_parallel`; ``remove()`` takes them off."""

    def __init__(self, module: nn.Module, plan: SequenceParallelPlan) -> None:
        self.module, self.plan = module, plan
        self._hooks: list[Any] = []
        self._stack: list[tuple[Any, SPRegion] | None] = []
        self._positions = _argument_positions(module, [*plan.shard_inputs, *filter(None, [plan.joint_text_input])],
                                              "shard_inputs")
        for field in ("shard_outputs", "gather_before", "gather_after"):
            for name in getattr(plan, field):
                _submodules(module, name, field)
        self._hooks.append(module.register_forward_pre_hook(self._enter, with_kwargs=True))
        self._hooks.append(module.register_forward_hook(self._exit, with_kwargs=True, always_call=True))
        for name, spec in plan.shard_outputs.items():
            self._hooks.append(module.get_submodule(name).register_forward_hook(self._shard_output_hook(name, spec)))
        for name, dim in plan.gather_before.items():
            self._hooks.append(module.get_submodule(name).register_forward_pre_hook(self._gather_hook(dim)))
        for pattern, spec in plan.shard_before.items():
            if not isinstance(spec, Mapping):
                raise ConfigError(f"shard_before[{pattern!r}] must map argument names to token dims, got {spec!r}",
                                  field="shard_before")
            for name, sub in _submodules(module, pattern, "shard_before"):
                positions = _argument_positions(sub, list(spec), f"shard_before[{pattern!r}]")
                self._hooks.append(sub.register_forward_pre_hook(self._shard_before_hook(name, spec, positions),
                                                                 with_kwargs=True))
        for name, dim in plan.gather_after.items():
            self._hooks.append(module.get_submodule(name).register_forward_hook(self._gather_after_hook(dim)))

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if getattr(self.module, "_sp_handle", None) is self:
            del self.module._sp_handle

    # ------------------------------------------------------------------ argument access
    def _get(self, args: tuple, kwargs: dict, name: str, positions: dict | None = None) -> Any:
        if name in kwargs:
            return kwargs[name]
        i = (self._positions if positions is None else positions).get(name)
        return args[i] if i is not None and i < len(args) else None

    def _set(self, args: list, kwargs: dict, name: str, value: Any, positions: dict | None = None) -> None:
        if name in kwargs:
            kwargs[name] = value
        else:
            args[(self._positions if positions is None else positions)[name]] = value

    def _region(self) -> SPRegion | None:
        region = current_region()
        return region if region is not None and region.owner is self else None

    # ------------------------------------------------------------------ hooks
    def _enter(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        from omni_core.distributed.parallel_state import get_sp_group

        if get_sp_group().world_size == 1 or current_region() is not None:  # trivial, or already inside one
            self._stack.append(None)
            return None
        plan = self.plan
        region = SPRegion.from_parallel_state(joint_text_side=plan.joint_text_side, owner=self)
        if plan.joint_text_input:
            text = self._get(args, kwargs, plan.joint_text_input)
            if text is not None:
                region.joint_text_len = text.shape[plan.joint_text_dim]
        args, kwargs = list(args), dict(kwargs)
        for name, dim in plan.shard_inputs.items():
            value = self._get(args, kwargs, name)
            if value is not None:
                self._set(args, kwargs, name, region.shard(value, dim, name=name))
        cm = use_forward_context(attn_strategy=build_sequence_parallel_attention(region))
        cm.__enter__()
        self._stack.append((cm, region))
        return tuple(args), kwargs

    def _exit(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        if not self._stack:
            return None
        entry = self._stack.pop()
        if entry is None:
            return None
        cm, region = entry
        try:
            if output is None or region.gathered or self.plan.gather_output is None or region.seq_len is None:
                return None
            return self._gather_output(output, region)
        finally:
            cm.__exit__(None, None, None)

    def _gather_output(self, output: Any, region: SPRegion) -> Any:
        dim = self.plan.gather_output

        def gather(t: torch.Tensor) -> torch.Tensor:
            return region.gather(t, dim)

        if isinstance(output, torch.Tensor):
            return gather(output)
        if isinstance(output, (tuple, list)):
            return _map_tokens(output, {self.plan.gather_output_index: dim}, lambda t, d: region.gather(t, d))
        if hasattr(output, "sample"):  # diffusers' Transformer2DModelOutput and friends
            output.sample = gather(output.sample)
            return output
        raise TypeError(f"sequence parallel: cannot gather an output of type {type(output).__name__}; set "
                        f"gather_output=None and gather_before=<submodule> in the plan")

    def _shard_output_hook(self, name: str, spec: Any) -> Callable:
        def hook(module: nn.Module, args: tuple, output: Any) -> Any:
            region = self._region()
            if region is None or not region.active:
                return None
            return _map_tokens(output, spec, lambda t, d: region.shard(t, d, name=f"output of {name}"))
        return hook

    def _shard_before_hook(self, name: str, spec: Mapping[str, int], positions: dict) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> Any:
            region = self._region()
            if region is None or not region.active or name in region.fired:
                return None
            region.fired.add(name)  # once per forward: later calls already get sharded tokens
            args, kwargs = list(args), dict(kwargs)
            for arg, dim in spec.items():
                value = self._get(args, kwargs, arg, positions)
                if isinstance(value, (torch.Tensor, tuple, list)):
                    self._set(args, kwargs, arg, _shard_argument(region, value, dim, f"{arg} of {name}"), positions)
            return tuple(args), kwargs
        return hook

    def _gather_after_hook(self, dim: int) -> Callable:
        def hook(module: nn.Module, args: tuple, output: Any) -> Any:
            region = self._region()
            if region is None or not region.active or region.seq_len is None:
                return None
            region.end()
            if isinstance(output, torch.Tensor):
                return region.gather(output, dim)
            return _map_tokens(output, {0: dim}, lambda t, d: region.gather(t, d))
        return hook

    def _gather_hook(self, dim: int) -> Callable:
        def hook(module: nn.Module, args: tuple) -> Any:
            region = self._region()
            if region is None or not region.active or region.seq_len is None:
                return None
            region.end()
            return (region.gather(args[0], dim), *args[1:])
        return hook


def _submodules(module: nn.Module, pattern: str, field: str) -> list[tuple[str, nn.Module]]:
    """(path, submodule) for a plan's path, where ``*`` matches one segment; ConfigError when none exists."""
    if "*" not in pattern:
        try:
            return [(pattern, module.get_submodule(pattern))]
        except AttributeError:
            found = []
    else:
        regex = re.compile(re.escape(pattern).replace(r"\*", r"[^.]+"))
        found = [(name, sub) for name, sub in module.named_modules() if regex.fullmatch(name)]
    if not found:
        raise ConfigError(f"sequence-parallel plan of {type(module).__name__} names submodule {pattern!r} in {field}, "
                          f"which does not exist", field=field)
    return found


def _shard_argument(region: SPRegion, value: Any, dim: int, name: str) -> Any:
    """A ``shard_before`` argument's shard: a tensor, or each tensor of a tuple; a tensor of length 1 along
    ``dim`` broadcasts over the region's tokens (kept whole) once the region knows it holds more than one."""
    if isinstance(value, (tuple, list)):
        return type(value)(_shard_argument(region, v, dim, f"{name}[{i}]") for i, v in enumerate(value))
    if not isinstance(value, torch.Tensor):
        return value
    if value.shape[dim] == 1 and region.seq_len is not None and region.seq_len > 1:
        return value
    return region.shard(value, dim, name=name)


def _argument_positions(module: nn.Module, names: list[str], field: str) -> dict[str, int]:
    """Positions of ``module.forward``'s parameters; ConfigError when ``names`` has one it does not take."""
    params = list(inspect.signature(module.forward).parameters.values())
    known = {p.name for p in params}
    if not any(p.kind == p.VAR_KEYWORD for p in params):
        for name in names:
            if name not in known:
                hint = suggest(name, sorted(known))
                raise ConfigError(f"sequence-parallel plan ({field}) names argument {name!r}, which "
                                  f"{type(module).__name__}.forward does not take"
                                  + (f"; did you mean {hint!r}?" if hint else ""), field=field)
    return {p.name: i for i, p in enumerate(params) if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)}


def apply_sequence_parallel(module: nn.Module, plan: Any = None) -> SequenceParallelHandle:
    """Install the plan's hooks on ``module`` (``plan`` defaults to ``module._sp_plan``, for code that shards a
    bare module; pipelines declare plans in their ``DenoiserSpec``). Idempotent: a second call replaces the
    first. The hooks decide per forward, so it is safe to apply in any configuration."""
    if plan is None:
        plan = getattr(module, "_sp_plan", None)
        if plan is None:
            raise ConfigError(f"{type(module).__name__} declares no _sp_plan; pass a SequenceParallelPlan",
                              field="_sp_plan")
    old = getattr(module, "_sp_handle", None)
    if old is not None:
        old.remove()
    handle = SequenceParallelHandle(module, SequenceParallelPlan.coerce(plan))
    module._sp_handle = handle
    return handle


def apply_sequence_parallel_to_pipeline(pipeline: Any, config: Any = None) -> list[str]:
    """Sequence parallelism for any pipeline, from its declared denoiser specs (``pipeline.denoisers()``).

    Checks ``config.parallel_config`` against every spec's loaded head counts (Ulysses needs each ``num_heads``
    divisible by its degree; the strategies a pipeline supports are checked once, from its record, by the
    engine's plan: :func:`omni_core.pipelines.loader.check_parallel_support`) and, when the sp group has more than one rank, installs each
    spec's ``sp_plan`` on its module. Runs once in every worker after ``init_parallel_state`` and ``load``
    (:func:`omni_core.pipelines.loader.load_pipeline`), so a model gets SP by declaring a plan and nothing else.
    Returns the names of the denoisers whose plan was installed. A ``ConfigError`` when SP is asked for and the
    pipeline declares specs but none with a plan; a pipeline that declares no specs at all is left alone (it
    predates specs and installs its own hooks).
    """
    from omni_core.distributed import get_sp_group, validate_parallel_config

    specs = list(pipeline.denoisers()) if hasattr(pipeline, "denoisers") else []
    model = type(pipeline).__name__
    pc = getattr(config, "parallel_config", None)
    for spec in specs:
        validate_parallel_config(pc, num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads,
                                 model=f"{model} ({spec.name})" if len(specs) > 1 else model)
    if get_sp_group().world_size == 1:
        return []
    planned = [spec for spec in specs if spec.sp_plan is not None]
    if specs and not planned:
        raise ConfigError(f"{model} declares no sequence-parallel plan (no DenoiserSpec from denoisers() has an "
                          f"sp_plan), so ulysses/ring parallelism cannot shard it; declare sp_plan in its specs or "
                          f"use cfg or data parallelism", field="parallel_config")
    for spec in planned:
        apply_sequence_parallel(spec.module, spec.sp_plan)
    return [spec.name for spec in planned]

"""Tensor parallelism by declaration: a model names which of its layers split by output or by input; the core
shards them over the ``tp`` group, reads only each rank's shard, and adds the one collective each split needs.

A model declares the plan in its :class:`~omni_core.pipelines.denoiser.DenoiserSpec` (``tp_plan``), keyed by
module path below the denoiser, where ``*`` matches one path segment (a block index)::

    tp_plan={
        "blocks.*.attn.to_q": "colwise", "blocks.*.attn.to_k": "colwise", "blocks.*.attn.to_v": "colwise",
        "blocks.*.attn.to_out.0": "rowwise",
        "blocks.*.ff.net.0.proj": "colwise", "blocks.*.ff.net.2": "rowwise",
        "blocks.*.norm1.linear": "colwise_gather",     # adaLN modulation: weights split, output whole
        "blocks.*.attn.norm_q": "norm_across_heads",   # an RMSNorm over all heads (Wan)
        "single_blocks.*.proj_out": {"style": "rowwise", "segments": ["attn.inner_dim", "proj_mlp.out_features"]},
        "blocks.*.ff.linear_in": {"style": "colwise", "segments": ["linear_out.in_features"] * 2},  # [gate | up]
    }

The styles (Megatron-LM's column/row split, which torch's ``ColwiseParallel``/``RowwiseParallel`` also express):

* ``colwise``   -- ``Linear`` weight rows (and bias) split: each rank computes its slice of the outputs (its
  heads, its share of the MLP's hidden units). No collective. ``segments`` says the output is a concatenation of
  parts each split on its own, so a rank's output is its slice of every part, in order (a SwiGLU's fused
  ``[gate | up]``, FLUX.2's fused ``[q | k | v | gate | up]``): the model's own ``chunk``/``split`` of the output
  then finds its parts, with its widths divided like the heads.
* ``rowwise``   -- ``Linear`` weight columns split: each rank multiplies its slice of the inputs (the local heads'
  output, the local hidden units); one all-reduce sums the partial products, then the bias is added once.
  ``segments`` (attribute paths from the layer's parent, or sizes, read before anything is split) says the input
  is a concatenation of parts each split on its own (FLUX's single-stream ``proj_out`` over attention and MLP
  outputs).
* ``colwise_gather`` -- ``colwise`` whose output is all-gathered back to whole (a modulation ``Linear`` whose
  output is chunked into shift/scale/gate: its weights are a large share of a DiT's, its output is small).
* ``norm_across_heads`` -- an RMSNorm over the concatenated heads (Wan's ``norm_q``/``norm_k``): its weight is
  split like the heads, the mean of squares is all-reduced.
* ``heads`` -- not a layer but an attention module of the model's own whose head count must become the local
  one (its ``heads`` / ``num_heads`` / ``num_kv_heads`` / ``inner_dim`` ... attributes, and the Omni ``Attention``
  layers among its children); diffusers' attention modules need no entry: a split ``to_q`` implies it.

Attention modules whose ``to_q`` is split get their head count (``heads``, ``inner_dim``, ``inner_kv_dim``,
``kv_inner_dim``) divided, so attention processors that ``unflatten`` by ``attn.heads`` see the local heads;
attention layers (and Ulysses inside a TP group) see local heads. Why our own layer over plain collectives rather
than ``torch.distributed.tensor.parallel`` (DTensor): measured (``bench/parallel_tp.py``, 2026-12-04, 2 CPU cores,
gloo: a TP-2 forward of a Qwen-Image transformer of width 512 with the Qwen-Image plan, which DTensor expresses
as it is), ``parallelize_module`` with ``ColwiseParallel``/``RowwiseParallel`` took 2.1-2.8x the time of this layer
(about 45 ms more per block, at 2 and 4 blocks), both equal to one process within 1e-6 and holding the same
bytes; DTensor also has no style for ``norm_across_heads`` or a segmented ``rowwise``. And the plain layer keeps
the weights plain tensors, so torchao quantization, the hook registry and ``torch.compile`` see ordinary
``Linear`` modules.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Mapping

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from omni_core.errors import ConfigError, suggest
from omni_core.hooks import FunctionHook, STAGES, add_hook

STYLES = ("colwise", "rowwise", "colwise_gather", "norm_across_heads", "heads")
#: the hook name on split layers that need a collective
HOOK = "omni.tensor_parallel"
#: attributes of an attention module that count heads or head-sized widths (divided by the TP size)
HEAD_ATTRS = ("heads", "num_heads", "num_kv_heads", "inner_dim", "inner_kv_dim", "kv_inner_dim")


@attrs.frozen
class LayerStyle:
    """How one declared layer splits."""

    style: str
    #: ``rowwise``: the concatenated input parts, ``colwise``: the concatenated output parts, each split on its own:
    #: attribute paths (from the layer's parent) of their sizes, or the sizes
    segments: tuple[str | int, ...] = ()

    @classmethod
    def coerce(cls, value: Any, where: str) -> LayerStyle:
        if isinstance(value, LayerStyle):
            return value
        if isinstance(value, str):
            value = {"style": value}
        if not isinstance(value, Mapping) or "style" not in value or set(value) - {"style", "segments"}:
            raise ConfigError(f"tp_plan[{where!r}] must be one of {', '.join(STYLES)} or "
                              f"{{'style': ..., 'segments': [...]}}, got {value!r}", field="tp_plan")
        style = value["style"]
        if style not in STYLES:
            hint = suggest(str(style), STYLES)
            raise ConfigError(f"tp_plan[{where!r}] style {style!r} is not one of {', '.join(STYLES)}"
                              + (f" (did you mean {hint!r}?)" if hint else ""), field="tp_plan")
        segments = tuple(value.get("segments") or ())
        if segments and style not in ("rowwise", "colwise"):
            raise ConfigError(f"tp_plan[{where!r}]: segments apply to 'rowwise' and 'colwise' layers only (a "
                              f"gathered output comes back rank by rank, not part by part)", field="tp_plan")
        return cls(style, segments)


@attrs.frozen
class TensorParallelPlan:
    """A denoiser's declared tensor-parallel split: module path pattern -> :class:`LayerStyle`."""

    layers: Mapping[str, LayerStyle]

    @classmethod
    def coerce(cls, value: Any) -> TensorParallelPlan | None:
        if value is None or isinstance(value, TensorParallelPlan):
            return value
        if not isinstance(value, Mapping) or not value:
            raise ConfigError(f"tp_plan must map module paths to styles ({', '.join(STYLES)}), got {value!r}",
                              field="tp_plan")
        return cls({str(k): LayerStyle.coerce(v, str(k)) for k, v in value.items()})

    def resolve(self, module: nn.Module) -> dict[str, LayerStyle]:
        """``{module path: style}`` of every layer of ``module`` the plan names; a pattern that matches nothing
        is an error naming it (a renamed layer must not silently stay whole)."""
        names = [name for name, _ in module.named_modules() if name]
        out: dict[str, LayerStyle] = {}
        for pattern, style in self.layers.items():
            regex = re.compile(re.escape(pattern).replace(r"\*", r"[^.]+"))
            hits = [n for n in names if regex.fullmatch(n)]
            if not hits:
                hint = suggest(pattern, names)
                raise ConfigError(f"tp_plan names {pattern!r}, which matches no module of "
                                  f"{type(module).__name__}" + (f" (did you mean {hint!r}?)" if hint else ""),
                                  field="tp_plan")
            for n in hits:
                out[n] = style
        return out


@attrs.frozen
class ParamShard:
    """Which slice of a full parameter a rank holds: ``dim`` split in ``tp`` parts (per segment), or the whole
    tensor on rank 0 and zeros elsewhere is never used: a replicated parameter has no ParamShard."""

    dim: int
    #: sizes along ``dim`` of the parts that are split one by one (one part: the whole dim)
    segments: tuple[int, ...]

    def local_size(self, tp: int) -> int:
        return sum(s // tp for s in self.segments)

    def ranges(self, rank: int, tp: int) -> list[tuple[int, int]]:
        """``[(start, length)]`` along ``dim`` of this rank's pieces of the full tensor, in order."""
        out, offset = [], 0
        for size in self.segments:
            part = size // tp
            out.append((offset + rank * part, part))
            offset += size
        return out

    def take(self, full: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
        pieces = [full.narrow(self.dim, start, length) for start, length in self.ranges(rank, tp)]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=self.dim)


def _size(parent: nn.Module, path: str | int) -> int:
    if isinstance(path, int):
        return path
    value: Any = parent
    for part in path.split("."):
        value = getattr(value, part)
    return int(value)


def param_shards(module: nn.Module, layers: Mapping[str, LayerStyle], tp: int) -> dict[str, ParamShard]:
    """``{parameter name: ParamShard}`` of every split parameter (names as in ``module.state_dict()``), read
    from the unsplit module (real or on ``meta``); an error naming the layer when a size does not divide."""
    out: dict[str, ParamShard] = {}
    for name, style in layers.items():
        layer = module.get_submodule(name)
        parent = module.get_submodule(name.rpartition(".")[0]) if "." in name else module
        if style.style == "heads":
            continue
        if style.style == "norm_across_heads":
            weight = getattr(layer, "weight", None)
            if weight is not None:
                out[f"{name}.weight"] = ParamShard(0, (weight.shape[0],))
            continue
        if not isinstance(layer, nn.Linear):
            raise ConfigError(f"tp_plan: {name!r} is a {type(layer).__name__}, but {style.style!r} applies to "
                              f"nn.Linear layers", field="tp_plan")
        if style.style in ("colwise", "colwise_gather"):
            shard = ParamShard(0, _segments(parent, name, style, layer.out_features, "outputs"))
            out[f"{name}.weight"] = shard
            if layer.bias is not None:
                out[f"{name}.bias"] = shard
        else:
            out[f"{name}.weight"] = ParamShard(1, _segments(parent, name, style, layer.in_features, "inputs"))
    for pname, shard in out.items():
        bad = [s for s in shard.segments if s % tp]
        if bad:
            raise ConfigError(f"tensor_parallel_size={tp} does not divide {pname} (size {bad[0]} along dim "
                              f"{shard.dim}); allowed: a divisor of the model's head count and widths",
                              field="parallel_config.tensor_parallel_size")
    return out


def _segments(parent: nn.Module, name: str, style: LayerStyle, width: int, what: str) -> tuple[int, ...]:
    """The sizes of the parts split one by one along the layer's ``what`` (one part: all ``width`` of them)."""
    segments = tuple(_size(parent, s) for s in style.segments) or (width,)
    if sum(segments) != width:
        raise ConfigError(f"tp_plan: {name!r} segments {list(style.segments)} = {list(segments)} do not add up to "
                          f"its {width} {what}", field="tp_plan")
    return segments


def _local_param(param: torch.Tensor, shard: ParamShard, rank: int, tp: int) -> nn.Parameter:
    if param.device.type == "meta":
        shape = list(param.shape)
        shape[shard.dim] = shard.local_size(tp)
        local = torch.empty(shape, dtype=param.dtype, device="meta")
    else:
        local = shard.take(param.detach(), rank, tp).clone()
    return nn.Parameter(local, requires_grad=False)


def _rowwise(group: Any) -> Callable[..., Any]:
    def forward(below: Callable[..., Any], x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        layer = forward.layer
        out = F.linear(x, layer.weight)
        group.all_reduce(out)
        return out if layer.bias is None else out + layer.bias
    return forward


def _gather(group: Any) -> Callable[..., Any]:
    def forward(below: Callable[..., Any], *args: Any, **kwargs: Any) -> torch.Tensor:
        return group.all_gather(below(*args, **kwargs), dim=-1)
    return forward


def _norm_across_heads(group: Any, full_width: int) -> Callable[..., Any]:
    def forward(below: Callable[..., Any], x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        norm = forward.layer
        eps = getattr(norm, "eps", None)
        eps = torch.finfo(torch.float32).eps if eps is None else eps
        xf = x.float()
        square_sum = xf.pow(2).sum(-1, keepdim=True)
        group.all_reduce(square_sum)
        out = (xf * torch.rsqrt(square_sum / full_width + eps)).to(x.dtype)
        weight = getattr(norm, "weight", None)
        return out if weight is None else out * weight
    return forward


def apply_tensor_parallel(module: nn.Module, plan: Any, group: Any) -> dict[str, ParamShard]:
    """Split ``module``'s declared layers over ``group`` (a GroupCoordinator): each parameter becomes this rank's
    slice (on ``meta`` when the module is on ``meta``: :func:`read_shards` fills it), layers that need a collective
    get a hook, attention modules get their local head count. Returns the parameter shards (for the loader).
    A no-op returning ``{}`` when the group has one rank."""
    plan = TensorParallelPlan.coerce(plan)
    tp = group.world_size
    if plan is None or tp == 1:
        return {}
    rank = group.rank_in_group
    layers = plan.resolve(module)
    shards = param_shards(module, layers, tp)
    widths = {name: _norm_width(module.get_submodule(name), name) for name, style in layers.items()
              if style.style == "norm_across_heads"}
    for pname, shard in shards.items():
        owner_name, _, attr = pname.rpartition(".")
        owner = module.get_submodule(owner_name)
        setattr(owner, attr, _local_param(getattr(owner, attr), shard, rank, tp))
    for name, style in layers.items():
        layer = module.get_submodule(name)
        if style.style == "heads":
            _split_heads(layer, name, tp)
            continue
        if style.style == "colwise":
            layer.out_features //= tp
            continue
        if style.style == "colwise_gather":
            layer.out_features //= tp
            fn = _gather(group)
        elif style.style == "rowwise":
            layer.in_features = layer.weight.shape[1]
            fn = _rowwise(group)
        else:
            fn = _norm_across_heads(group, widths[name])
        fn.layer = layer
        add_hook(layer, HOOK, FunctionHook(fn, order=STAGES["kernel"]))
    _divide_heads(module, layers, tp)
    return shards


def _norm_width(norm: nn.Module, name: str) -> int:
    """The full width an RMSNorm normalises over (before any split)."""
    shape = getattr(norm, "normalized_shape", None)
    if shape:
        return int(shape[-1])
    weight = getattr(norm, "weight", None)
    if weight is not None:
        return int(weight.shape[-1])
    raise ConfigError(f"tp_plan: {name!r} ('norm_across_heads') declares neither normalized_shape nor a weight, so "
                      f"its width is unknown", field="tp_plan")


def _divide_heads(module: nn.Module, layers: Mapping[str, LayerStyle], tp: int) -> None:
    """Local head counts on every attention module whose query projection (diffusers' ``to_q``) was split."""
    for name, style in layers.items():
        parent_name, _, leaf = name.rpartition(".")
        declared = layers.get(parent_name)
        if leaf == "to_q" and style.style == "colwise" and (declared is None or declared.style != "heads"):
            _split_heads(module.get_submodule(parent_name) if parent_name else module, parent_name, tp)


def _split_heads(attn: nn.Module, name: str, tp: int) -> None:
    """``attn``'s head counts and head-sized widths divided by ``tp``, and its Omni attention layers'."""
    heads = next((getattr(attn, a) for a in ("heads", "num_heads") if isinstance(getattr(attn, a, None), int)), None)
    if heads is None or heads % tp:
        raise ConfigError(f"tensor_parallel_size={tp} does not divide the {heads} heads of {name!r}; "
                          f"allowed: a divisor of the head count", field="parallel_config.tensor_parallel_size")
    for attr in HEAD_ATTRS:
        value = getattr(attn, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            setattr(attn, attr, value // tp)
    for child in attn.children():  # Omni attention layers (``Attention.split_heads``) installed on it see local heads
        if callable(getattr(child, "split_heads", None)):
            child.split_heads(tp)


# -- plan fragments for diffusers' shared layers (a model's plan is usually a few of these)

def attention_layers(path: str, *, joint: bool = False, output: bool = True,
                     norms_across_heads: tuple[str, ...] = (), added_kv: bool = False) -> dict[str, str]:
    """The split of a diffusers attention module at ``path``: query/key/value by output (heads), the output
    projection by input. ``joint``: the text stream's ``add_{q,k,v}_proj`` and ``to_add_out`` too (FLUX double
    blocks, Qwen-Image, SD3); ``output=False``: no ``to_out`` (FLUX single blocks, whose ``proj_out`` mixes
    attention and MLP outputs); ``norms_across_heads``: the RMSNorms over all heads (Wan's ``norm_q``/``norm_k``);
    ``added_kv``: image key/value projections (Wan I2V's ``add_k_proj``/``add_v_proj`` and ``norm_added_k``)."""
    out = {f"{path}.{p}": "colwise" for p in ("to_q", "to_k", "to_v")}
    if output:
        out[f"{path}.to_out.0"] = "rowwise"
    if joint:
        out.update({f"{path}.{p}": "colwise" for p in ("add_q_proj", "add_k_proj", "add_v_proj")})
        out[f"{path}.to_add_out"] = "rowwise"
    if added_kv:
        out.update({f"{path}.add_k_proj": "colwise", f"{path}.add_v_proj": "colwise"})
        if norms_across_heads:
            out[f"{path}.norm_added_k"] = "norm_across_heads"
    out.update({f"{path}.{n}": "norm_across_heads" for n in norms_across_heads})
    return out


def feed_forward_layers(path: str, first: tuple[str, ...] = ("net.0.proj",), last: str = "net.2") -> dict[str, str]:
    """The split of an MLP at ``path``: its input projections by output (hidden units), the last by input.
    Defaults fit diffusers' ``FeedForward``; a SwiGLU ``w2(silu(w1 x) * w3 x)`` is ``first=("w1", "w3"),
    last="w2"``."""
    return {**{f"{path}.{p}": "colwise" for p in first}, f"{path}.{last}": "rowwise"}


__all__ = ["HOOK", "LayerStyle", "ParamShard", "STYLES", "TensorParallelPlan", "apply_tensor_parallel",
           "attention_layers", "feed_forward_layers", "param_shards"]

"""What a model declares about each of its denoisers, so accelerators work on any model by declaration.

A cache backend (TeaCache, cache-dit, ...) and a sequence-parallel strategy need the same facts about a
denoiser: its module, its list of transformer blocks, how a block is called (which arguments flow from block
to block, which are per-row side inputs, what a block returns), the cheap per-row signal TeaCache compares
between steps, whether rows can be computed apart, the attention head count and where tokens are sharded.
A pipeline states them once, in a :class:`DenoiserSpec` per denoiser returned by ``OmniPipeline.denoisers()``;
backends read specs and never name a model class. Wan 2.2 returns two specs (its two experts).

The module imports neither torch nor a plugin; callables in a spec are called only in the worker.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Mapping

import attrs

from omni_core.errors import ConfigError
from omni_core.utils.denoisers import denoisers_of  # noqa: F401 (its home is below the pipelines)


def _names(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    return tuple(value)


def _coerce_plan(value: Any) -> Any:
    if value is None:
        return None
    from omni_core.attention.parallel.plan import SequenceParallelPlan  # imports torch: only when a plan is given

    return SequenceParallelPlan.coerce(value)


def _coerce_tp_plan(value: Any) -> Any:
    if value is None:
        return None
    from omni_core.distributed.tensor_parallel import TensorParallelPlan  # imports torch: only when a plan is given

    return TensorParallelPlan.coerce(value)


@attrs.frozen(kw_only=True)
class DenoiserSpec:
    """One denoiser module as accelerators see it. Field by field:

    * ``name`` -- how the pipeline calls it (``"transformer"``, Wan 2.2's ``"transformer_2"``); the key of a
      request's per-denoiser cache state and of the typed call context's ``expert``.
    * ``module`` -- the ``torch.nn.Module`` (its ``forward`` is what the pipeline calls).
    * ``blocks_attr`` -- attribute of ``module`` holding the ``nn.ModuleList`` of transformer blocks, or several
      (FLUX's double- then single-stream blocks), run one after the other with nothing between them that
      changes the streams, all with the same ``block_params`` and ``block_outputs``; ``blocks`` is their
      concatenation.
    * ``block_params`` -- the block forward's positional parameter names, in order (checked against the real
      signature by :meth:`check_block_signature`, so a library upgrade that renames one fails loudly).
    * ``carried`` -- the block parameters whose values flow from one block to the next (a block returns them).
    * ``block_outputs`` -- what a block returns, in order; a single name means it returns that tensor alone.
    * ``residual_stream`` -- the carried stream whose residual (last block's output minus block 0's input) a
      cache keeps and re-adds on a reused step.
    * ``side_inputs`` -- per-row block inputs every block receives unchanged (sliced when only some rows run).
    * ``batch_args`` -- ``module.forward`` parameters whose first dimension is the batch (sliced when a
      backend splits one call into one call per request).
    * ``modulated_input`` -- ``(module, block0, {param: value}) -> [B, ...]``: block 0's timestep-modulated
      input per row, TeaCache's signal; None if the model offers none (TeaCache then refuses the model).
    * ``rows_separable`` -- whether a call's rows can be computed apart (False, e.g. when a side input mixes
      rows: backends then run every row and overwrite the reused ones).
    * ``num_heads`` / ``num_kv_heads`` -- attention heads (Ulysses splits them; checked before workers start).
    * ``sp_plan`` -- where tokens are sharded and gathered for sequence parallelism (a
      :class:`~omni_core.attention.parallel.plan.SequenceParallelPlan` or its dict form); None: no SP.
    * ``tp_plan`` -- which layers tensor parallelism splits, by module path below ``module`` (``*`` matches a
      block index) -> ``"colwise"`` / ``"rowwise"`` / ``"colwise_gather"`` / ``"norm_across_heads"`` (a
      :class:`~omni_core.distributed.tensor_parallel.TensorParallelPlan` or its dict form); None: no TP.
    * ``cache_defaults`` -- per cache backend (by component name) the defaults this model ships, e.g.
      ``{"tea_cache": {"coefficients": (...), "rel_l1_thresh": 0.2, "warmup_steps": 1}}``; a user's
      ``cache_config`` overrides them key by key.
    """

    name: str
    module: Any
    blocks_attr: tuple[str, ...] = attrs.field(converter=_names)
    block_params: tuple[str, ...] = attrs.field(converter=_names)
    carried: tuple[str, ...] = attrs.field(converter=_names)
    block_outputs: tuple[str, ...] = attrs.field(converter=_names)
    residual_stream: str
    side_inputs: tuple[str, ...] = attrs.field(default=(), converter=_names)
    batch_args: tuple[str, ...] = attrs.field(default=(), converter=_names)
    modulated_input: Callable[[Any, Any, dict], Any] | None = None
    rows_separable: bool = True
    num_heads: int | None = None
    num_kv_heads: int | None = None
    sp_plan: Any = attrs.field(default=None, converter=_coerce_plan)
    tp_plan: Any = attrs.field(default=None, converter=_coerce_tp_plan)
    cache_defaults: Mapping[str, Mapping[str, Any]] = attrs.field(factory=dict)

    def __attrs_post_init__(self) -> None:
        where = f"DenoiserSpec {self.name!r}"
        if self.residual_stream not in self.carried:
            raise ConfigError(f"{where}: residual_stream {self.residual_stream!r} must be one of carried "
                              f"{list(self.carried)}", field="residual_stream")
        for group, names in (("carried", self.carried), ("side_inputs", self.side_inputs)):
            missing = [n for n in names if n not in self.block_params]
            if missing:
                raise ConfigError(f"{where}: {group} {missing} are not block parameters {list(self.block_params)}",
                                  field=group)
        if set(self.block_outputs) != set(self.carried):
            raise ConfigError(f"{where}: block_outputs {list(self.block_outputs)} must be the carried streams "
                              f"{list(self.carried)} (in the order a block returns them)", field="block_outputs")

    @property
    def blocks(self) -> Any:
        """The block list (the ``nn.ModuleList`` itself for one ``blocks_attr``; a list of all for several)."""
        if len(self.blocks_attr) == 1:
            return getattr(self.module, self.blocks_attr[0])
        return [block for attr in self.blocks_attr for block in getattr(self.module, attr)]

    def defaults_for(self, backend: str, model_path: str | None = None) -> dict[str, Any]:
        """The model's shipped defaults for cache backend ``backend`` (empty if it ships none): the spec's
        ``cache_defaults``, overridden key by key by the model folder's ``cache_defaults.json`` when
        ``model_path`` has one (see :func:`shipped_cache_defaults`)."""
        out = dict(self.cache_defaults.get(backend, {}))
        out.update(shipped_cache_defaults(model_path, self.name).get(backend, {}))
        return out

    def check_block_signature(self, who: str = "accelerator") -> None:
        """Refuse a block whose forward no longer takes ``block_params`` in order (e.g. a library upgrade
        renamed one), instead of slicing the wrong inputs."""
        for attr in self.blocks_attr:  # the first block of each list (a list holds one block class)
            block = getattr(self.module, attr)[0]
            names = [p.name for p in inspect.signature(block.forward).parameters.values()
                     if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
            if tuple(names[: len(self.block_params)]) != self.block_params:
                raise ConfigError(f"{who}: {type(block).__name__}.forward takes {names}, but the {self.name!r} "
                                  f"denoiser spec declares {list(self.block_params)}; the installed model code "
                                  f"changed", field="block_params")


#: the file in a model folder with calibrated cache defaults the model ships (``omni cache calibrate --write``)
CACHE_DEFAULTS_FILE = "cache_defaults.json"


def shipped_cache_defaults(model_path: str | None, denoiser: str | None = None) -> dict[str, dict[str, Any]]:
    """Per cache backend, the defaults a model folder ships in ``cache_defaults.json``, so a calibration run
    (or a model author) can ship fitted coefficients without a code change::

        {"tea_cache": {"coefficients": [...], "rel_l1_thresh": 0.1, "warmup_steps": 1,
                       "denoisers": {"transformer_2": {"coefficients": [...]}}}}

    A backend's ``"denoisers"`` entry overrides keys for the denoiser (spec name) ``denoiser``. Empty when
    ``model_path`` is None or has no such file; a file that is not such a JSON object is a ``ConfigError``."""
    import json
    import os

    if not model_path:
        return {}
    path = os.path.join(model_path, CACHE_DEFAULTS_FILE)
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path} is not readable JSON: {exc}", field="cache_defaults") from None
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise ConfigError(f"{path} must map cache backend names to objects of defaults, e.g. "
                          f'{{"tea_cache": {{"rel_l1_thresh": 0.1}}}}', field="cache_defaults")
    out: dict[str, dict[str, Any]] = {}
    for backend, values in data.items():
        values = dict(values)
        per = values.pop("denoisers", None) or {}
        if denoiser is not None and isinstance(per, dict):
            values.update(per.get(denoiser, {}))
        out[backend] = values
    return out


#: attribute ``load_pipeline`` sets on a loaded pipeline: the model folder it was loaded from
MODEL_PATH_ATTR = "omni_model_path"


def model_folder_of(pipeline: Any) -> str | None:
    """The folder ``pipeline`` was loaded from (set by the core's ``load_pipeline``), or None."""
    return getattr(pipeline, MODEL_PATH_ATTR, None)

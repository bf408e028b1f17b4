"""Which engine features combine, declared once as data: the pairs the engine refuses before any worker starts.

A *feature* is a named predicate on :class:`~omni_core.config.OmniDiffusionConfig` (``ulysses`` is
``parallel_config.ulysses_degree > 1``, ...): the core's own in :data:`FEATURES`, and one per installed cache
backend (``cache_backend=<name>``), made from its record. :data:`REFUSED` lists the pairs of core features that
cannot run together, each with the reason; a cache backend's record declares its own (``CacheBackendSpec.refuses``),
so this module names no plugin; :func:`check_combinations` raises a
:class:`~omni_core.errors.ConfigError` naming both options and the reason for the first such pair a config turns
on. The engine calls it with the rest of its start-up checks (``DiffusionEngine.__init__``), after the
performance preset has filled its options, so a preset cannot produce a refused pair either.

Pairs that are *one option* (``cache_backend``, ``offload``, ``step_execution``) cannot be written in a config at
all; :data:`ONE_OPTION` says so for the documentation's table. Refusals that depend on the machine rather than
on the pair (offload with more ranks than devices: ``omni_core.optimize.offload.check_offload``) stay where the
machine is known; :data:`PLATFORM_REFUSED` names them for the table. Everything else combines: the matrix test
(``tests/combos/test_matrix.py``) runs every pair on a tiny model and compares it with the same run without
the second feature, within that feature's tolerance (``omni_core/testing/combination_matrix.py``).

Import-light: no torch.
"""

from __future__ import annotations

from typing import Any, Callable

import attrs

from omni_core.errors import ConfigError


def _quantizes_denoiser(config: Any) -> bool:
    return (config.quantization not in (None, "none") and "denoiser" in tuple(config.quantize_components or ()))


@attrs.frozen
class Feature:
    """A feature a config can turn on: its name, the option(s) as a user writes them, and the predicate."""

    name: str
    option: str
    enabled: Callable[[Any], bool] = attrs.field(repr=False)


#: the core's features a config decides (``lora`` is per request: nothing to check; cache backends: :func:`all_features`)
FEATURES: dict[str, Feature] = {f.name: f for f in (
    Feature("int8", "quantization='int8' (of the denoiser)", _quantizes_denoiser),
    Feature("gguf", "denoiser_weights='<file>.gguf'", lambda c: c.denoiser_weights is not None),
    Feature("offload_model", "offload='model'", lambda c: c.offload == "model"),
    Feature("offload_group", "offload='group'", lambda c: c.offload == "group"),
    Feature("compile", "compile=True", lambda c: bool(c.compile)),
    Feature("vae_tiling", "vae_tiling", lambda c: bool(c.vae_tiling)),
    Feature("ulysses", "parallel_config.ulysses_degree > 1", lambda c: c.parallel_config.ulysses_degree > 1),
    Feature("ring", "parallel_config.ring_degree > 1", lambda c: c.parallel_config.ring_degree > 1),
    Feature("cfg_parallel", "parallel_config.cfg_parallel_size=2", lambda c: c.parallel_config.cfg_parallel_size > 1),
    Feature("step", "step_execution=True", lambda c: bool(c.step_execution)),
    Feature("request", "step_execution=False", lambda c: not c.uses_step_execution),
    Feature("streaming", "streaming_output=True", lambda c: bool(c.streaming_output)),
    Feature("tensor_parallel", "parallel_config.tensor_parallel_size > 1", lambda c: tensor_parallel(c)),
    Feature("encode_apart", "encode_workers=1", lambda c: bool(getattr(c, "encode_workers", 0))),
    Feature("decode_apart", "decode_workers=1", lambda c: bool(getattr(c, "decode_workers", 0))),
)}

#: pairs refused on every machine: ``(feature, feature) -> why`` (the ConfigError's reason)
REFUSED: dict[tuple[str, str], str] = {
    ("int8", "gguf"): "the GGUF file's denoiser weights are already quantized (dequantized per forward) and torchao "
                      "cannot quantize them again; quantize other components (quantize_components without "
                      "'denoiser') or drop one of the two",
}

#: pairs that are two values of one option, so no config can ask for both
ONE_OPTION: dict[tuple[str, str], str] = {
    ("offload_model", "offload_group"): "one option (offload)",
    ("step", "request"): "one option (step_execution)",
}

#: pairs refused only where the machine cannot hold them, by the check named
PLATFORM_REFUSED: dict[tuple[str, str], str] = {
    (off, par): "refused where the ranks outnumber the devices (always on CPU): ranks sharing a device would each "
                "keep a host copy (omni_core/optimize/offload.py check_offload)"
    for off in ("offload_model", "offload_group") for par in ("ulysses", "ring", "cfg_parallel")}


#: why LoRA adapters (preloaded or per request) are refused with tensor parallelism
TENSOR_PARALLEL_LORA = ("LoRA adapters are full-size while the layers they adapt are split across the "
                        "tensor-parallel ranks (splitting adapters is not built); use tensor_parallel_size=1 "
                        "(sequence or CFG parallelism serve LoRA)")
_OFFLOAD_TP = ("offload moves whole modules to the host and back; tensor parallelism already splits the denoiser "
               "over the ranks' devices")
REFUSED.update({
    ("int8", "tensor_parallel"): "torchao's per-row scales would cover each rank's share of a split layer's inputs "
                                 "only, so a TP run would not equal the quantized model; quantize other components "
                                 "(quantize_components without 'denoiser')",
    ("gguf", "tensor_parallel"): "a GGUF file's denoiser weights are read whole, not by tensor-parallel shard",
    ("offload_model", "tensor_parallel"): _OFFLOAD_TP,
    ("offload_group", "tensor_parallel"): _OFFLOAD_TP,
    ("compile", "tensor_parallel"): "compiling the split layers' collectives is not built yet",
    # ``lora`` is per request (no config predicate): the pair is checked where adapters are named (``loras`` at
    # start-up below, a request's ``lora`` in omni_core.lora.files) and shown in the combination table
    ("lora", "tensor_parallel"): TENSOR_PARALLEL_LORA,
})
_OFFLOAD_STAGE = ("offload moves the whole pipeline's components in turn on the model's device; with a stage apart "
                  "its own process would hold that stage's components whole")
_DECODE_PARALLEL = ("several model ranks decode together (the parallel VAE decode splits the VAE across them); a "
                    "decode process apart serves replicas of one model process each (data parallelism)")
REFUSED.update({(off, stage): _OFFLOAD_STAGE for off in ("offload_model", "offload_group")
                for stage in ("encode_apart", "decode_apart")})
REFUSED.update({(par, "decode_apart"): _DECODE_PARALLEL
                for par in ("ulysses", "ring", "cfg_parallel", "tensor_parallel")})
#: the features refused with tensor parallelism and why (a view of :data:`REFUSED`)
TENSOR_PARALLEL_REFUSED: dict[str, str] = {a: why for (a, b), why in REFUSED.items()
                                           if b == "tensor_parallel" and a != "lora"}


def tensor_parallel(config: Any) -> bool:
    pc = getattr(config, "parallel_config", None)
    return pc is not None and pc.tensor_parallel_size > 1


def _cache_records() -> dict[str, Any]:
    from omni_core.plugins.manager import get_plugin_manager

    return dict(get_plugin_manager().components("cache"))


def all_features() -> dict[str, Feature]:
    """:data:`FEATURES` and one feature per installed cache backend but ``none`` (``cache_backend=<name>``)."""
    caches = {name: Feature(name, f"cache_backend={name!r}", lambda c, n=name: c.cache_backend == n)
              for name in _cache_records() if name != "none"}
    return {**caches, **FEATURES}


def refusal(a: str, b: str) -> str | None:
    """The reason ``a`` and ``b`` are refused together on every machine (either order), or None: the core's
    :data:`REFUSED`, or what a cache backend's record declares."""
    why = REFUSED.get((a, b)) or REFUSED.get((b, a))
    if why is None:
        records = _cache_records()
        for mine, other in ((a, b), (b, a)):
            if mine in records:
                why = why or dict(getattr(records[mine], "refuses", ())).get(other)
    return why


def one_option(a: str, b: str) -> str | None:
    """Why no config can ask for both (two values of one option: two cache backends too), or None."""
    why = ONE_OPTION.get((a, b)) or ONE_OPTION.get((b, a))
    if why is None and {a, b} <= set(_cache_records()):
        why = "one option (cache_backend): one cache backend per engine"
    return why


def enabled_features(config: Any) -> list[str]:
    """Names of the features ``config`` turns on, in :func:`all_features` order."""
    return [name for name, f in all_features().items() if f.enabled(config)]


def check_combinations(config: Any) -> None:
    """Raise :class:`ConfigError` for the first refused pair ``config`` turns on: the message names both
    options and why (``field`` is the second option's config field)."""
    on = enabled_features(config)
    features = all_features()
    if "tensor_parallel" in on and getattr(config, "loras", None):
        raise ConfigError(f"loras cannot be combined with parallel_config.tensor_parallel_size > 1: "
                          f"{TENSOR_PARALLEL_LORA}", field="loras")
    for i, a in enumerate(on):
        for b in on[i + 1:]:
            why = refusal(a, b)
            if why is not None:
                field = _field(a if b == "tensor_parallel" else b)  # the option to drop, not the parallel layout
                raise ConfigError(f"{features[a].option} cannot be combined with {features[b].option}: {why}",
                                  field=field)


def _field(feature: str) -> str:
    if feature not in FEATURES:
        return "cache_backend"  # a cache backend's feature
    return {"int8": "quantization", "gguf": "denoiser_weights", "ulysses": "parallel_config",
            "ring": "parallel_config", "cfg_parallel": "parallel_config", "tensor_parallel": "parallel_config",
            "offload_model": "offload", "offload_group": "offload", "encode_apart": "encode_workers",
            "decode_apart": "decode_workers"}.get(feature, feature)

"""What TeaCache needs to know about each denoiser it supports.

An adapter names the transformer's block list and the block call's parameters: which ones carry the token
streams from block to block (``carried``; ``hidden`` is the one whose residual is cached), which are per-row
side inputs to slice when only some rows compute (``side``), and which forward-context extras are per-row
(``context_keys``, e.g. Wan's text key-padding mask). ``modulated`` returns block 0's timestep-modulated
input for every row -- the cheap signal TeaCache compares between steps. ``coefficients`` rescale its relative
L1 change into an estimate of the output's change (a degree-4 polynomial, highest power first, as
``numpy.polyfit`` returns it).
"""

from __future__ import annotations

from typing import Any, Callable

import attrs


@attrs.frozen(kw_only=True)
class ModelAdapter:
    name: str
    #: transformer class names this adapter serves
    classes: tuple[str, ...]
    blocks_attr: str
    #: the block forward's parameter names, in order (checked against the real signature at enable time)
    params: tuple[str, ...]
    #: parameters whose values flow from one block to the next (they are what a block returns)
    carried: tuple[str, ...]
    #: what a block returns, in order (a single name: it returns that tensor alone)
    outputs: tuple[str, ...]
    #: the carried stream whose residual (last block's output minus block 0's input) is cached
    hidden: str
    #: per-row inputs that every block receives unchanged (sliced when only some rows compute)
    side: tuple[str, ...] = ()
    #: per-row tensors read from ``forward_context().extras`` inside the blocks
    context_keys: tuple[str, ...] = ()
    #: (transformer, block 0, {param: value}) -> per-row modulated input ``[B, ...]``
    modulated: Callable[[Any, Any, dict], Any]
    #: (transformer) -> default (coefficients, rel_l1_thresh, warmup_steps)
    defaults: Callable[[Any], tuple[tuple[float, ...], float, int]]
    #: (transformer) -> whether rows can be computed apart (False: all rows run, reused rows are overwritten)
    can_slice: Callable[[Any], bool] = lambda transformer: True


# ---------------------------------------------------------------------------------------------- Qwen-Image
#: published by ComfyUI-TeaCache and used by vLLM-Omni for QwenImageTransformer2DModel
QWEN_IMAGE_COEFFICIENTS = (-4.5e02, 2.8e02, -4.5e01, 3.2e00, -2.0e-02)


def _qwen_modulated(transformer: Any, block: Any, a: dict) -> Any:
    """``img_norm1(hidden)`` modulated by the first third of ``img_mod(temb)`` (as the block itself does)."""
    mod1 = block.img_mod(a["temb"]).chunk(2, dim=-1)[0]
    return block._modulate(block.img_norm1(a["hidden_states"]), mod1, a.get("modulate_index"))[0]


QWEN_IMAGE = ModelAdapter(
    name="qwen-image",
    classes=("QwenImageTransformer2DModel",),
    blocks_attr="transformer_blocks",
    params=("hidden_states", "encoder_hidden_states", "encoder_hidden_states_mask", "temb", "image_rotary_emb",
            "joint_attention_kwargs", "modulate_index"),
    carried=("hidden_states", "encoder_hidden_states"),
    outputs=("encoder_hidden_states", "hidden_states"),
    hidden="hidden_states",
    side=("encoder_hidden_states_mask", "temb", "modulate_index"),
    modulated=_qwen_modulated,
    defaults=lambda transformer: (QWEN_IMAGE_COEFFICIENTS, 0.2, 1),
    # zero_cond_t doubles temb's batch ([cond rows; zero-t rows]): run every row, overwrite the reused ones
    can_slice=lambda transformer: not getattr(transformer.config, "zero_cond_t", False),
)

# ---------------------------------------------------------------------------------------------------- Wan
#: TeaCache4Wan2.1 "ret_steps" polynomials (input: the timestep projection ``e0``), by model width
WAN_1_3B_COEFFICIENTS = (-5.21862437e04, 9.23041404e03, -5.28275948e02, 1.36987616e01, -4.99875664e-02)
WAN_14B_COEFFICIENTS = (-3.03318725e05, 4.90537029e04, -2.65530556e03, 5.87365115e01, -3.15583525e-01)


def _wan_defaults(transformer: Any) -> tuple[tuple[float, ...], float, int]:
    """TeaCache4Wan2.1 with ``use_ret_steps``: the first 5 steps always compute; 0.08 (1.3B) / 0.2 (14B)
    are its "fast" thresholds (~2x)."""
    width = transformer.config.num_attention_heads * transformer.config.attention_head_dim
    if width <= 2048:
        return WAN_1_3B_COEFFICIENTS, 0.08, 5
    return WAN_14B_COEFFICIENTS, 0.2, 5


WAN = ModelAdapter(
    name="wan",
    classes=("WanTransformer3DModel",),
    blocks_attr="blocks",
    params=("hidden_states", "encoder_hidden_states", "temb", "rotary_emb"),
    carried=("hidden_states",),
    outputs=("hidden_states",),
    hidden="hidden_states",
    side=("encoder_hidden_states", "temb"),
    context_keys=("text_mask",),
    # TeaCache4Wan2.1 compares the timestep projection e0 (what every block's ``temb`` is)
    modulated=lambda transformer, block, a: a["temb"],
    defaults=_wan_defaults,
)

# ------------------------------------------------------------------------------------------------- shapes
#: fitted on the shipped weights with ``omni cache calibrate --model shapes --prompts 48 --steps 50`` (guidance 3.0;
#: 4704 step pairs, R^2 0.34); refit when the model is retrained
SHAPES_COEFFICIENTS: tuple[float, ...] = (2.74887208e+04, -3.81222300e+03, 2.08794877e+02, -5.95705452e+00, 8.32354849e-02)
#: tuned on 120 prompts at 50 steps: ~4x fewer evaluations, PSNR ~35 dB, evaluator accuracy unchanged
SHAPES_THRESH = 0.03
SHAPES_WARMUP = 1


def _shapes_modulated(transformer: Any, block: Any, a: dict) -> Any:
    return transformer.modulated_input(0, a["hidden"], a["temb"])


SHAPES = ModelAdapter(
    name="shapes",
    classes=("ShapesTransformer2DModel",),
    blocks_attr="blocks",
    params=("hidden", "temb", "context", "context_mask"),
    carried=("hidden",),
    outputs=("hidden",),
    hidden="hidden",
    side=("temb", "context", "context_mask"),
    modulated=_shapes_modulated,
    defaults=lambda transformer: (SHAPES_COEFFICIENTS, SHAPES_THRESH, SHAPES_WARMUP),
)

ADAPTERS = (QWEN_IMAGE, WAN, SHAPES)


def adapter_for(transformer: Any) -> ModelAdapter:
    """The adapter serving ``transformer``'s class; a clear error naming the supported ones otherwise."""
    name = type(transformer).__name__
    for adapter in ADAPTERS:
        if name in adapter.classes:
            return adapter
    known = ", ".join(c for a in ADAPTERS for c in a.classes)
    raise ValueError(f"tea_cache has no extractor for {name}; supported denoisers: {known} (add a ModelAdapter "
                     f"in omni_cache_teacache.adapters)")


def check_signature(adapter: ModelAdapter, block: Any) -> None:
    """Refuse a block whose forward no longer takes the parameters the adapter expects (e.g. a diffusers
    upgrade renamed one), instead of slicing the wrong inputs."""
    import inspect

    names = [p.name for p in inspect.signature(block.forward).parameters.values()
             if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if tuple(names[: len(adapter.params)]) != adapter.params:
        raise ValueError(f"tea_cache: {type(block).__name__}.forward takes {names}, but the {adapter.name} "
                         f"adapter expects {list(adapter.params)}; the installed model code changed")

"""What accelerators read of LTX-2's transformer (its :class:`~omni_core.pipelines.denoiser.DenoiserSpec`): the
block's parameters and per-row side inputs, the cache defaults, the tensor-parallel plan, TeaCache's signal."""

from __future__ import annotations

from typing import Any

import torch

from omni_core.pipelines.denoiser import DenoiserSpec

#: the transformer block's positional parameters (diffusers 0.42.1 ``LTX2VideoTransformerBlock.forward``)
BLOCK_PARAMS = ("hidden_states", "audio_hidden_states", "encoder_hidden_states", "audio_encoder_hidden_states",
                "temb", "temb_audio", "temb_ca_scale_shift", "temb_ca_audio_scale_shift", "temb_ca_gate",
                "temb_ca_audio_gate", "temb_prompt", "temb_prompt_audio", "video_rotary_emb", "audio_rotary_emb",
                "ca_video_rotary_emb", "ca_audio_rotary_emb", "encoder_attention_mask",
                "audio_encoder_attention_mask")
#: per-row block inputs every block receives unchanged (the rotary tables are per row too: ``[B, H, S, d]``)
SIDE_INPUTS = ("encoder_hidden_states", "audio_encoder_hidden_states", "temb", "temb_audio", "temb_ca_scale_shift",
               "temb_ca_audio_scale_shift", "temb_ca_gate", "temb_ca_audio_gate", "encoder_attention_mask",
               "audio_encoder_attention_mask")


#: TeaCache: no LTX-2 polynomial is published. These are fitted by ``omni_cache_teacache.calibrate.collect`` (what
#: ``omni cache calibrate`` runs) on the tiny test folder (8 prompts, 20 steps, CFG 3 with STG and modality off,
#: 32x32x9; 304 step pairs, input changes 0.034-0.094, R^2 0.15: the random tiny model's output change follows its
#: input's loosely): what the tests run on. Calibrate a released folder before relying on them (``omni cache
#: calibrate --model <folder> --write`` stores its own in the folder's cache_defaults.json, which overrides these).
TEACACHE_COEFFICIENTS = (-547698.5803901741, 137990.21576726847, -12624.24895114439, 497.275579954105,
                         -6.922225612930497)
TEACACHE_DEFAULTS = {"coefficients": TEACACHE_COEFFICIENTS, "rel_l1_thresh": 0.3, "warmup_steps": 1}
#: cache_dit: first block computed, the rest reused while the residual change stays under the threshold
CACHE_DIT_DEFAULTS = {"residual_diff_threshold": 0.3, "max_warmup_steps": 2}


def denoiser_spec(model: Any) -> DenoiserSpec:
    """The joint transformer: two carried streams (video, the residual a cache keeps; audio), the per-row
    timestep modulation ``temb`` as TeaCache's signal."""
    return DenoiserSpec(
        name="transformer", module=model, blocks_attr="transformer_blocks", block_params=BLOCK_PARAMS,
        carried=("hidden_states", "audio_hidden_states"), block_outputs=("hidden_states", "audio_hidden_states"),
        residual_stream="hidden_states", side_inputs=SIDE_INPUTS,
        batch_args=("hidden_states", "audio_hidden_states", "encoder_hidden_states", "audio_encoder_hidden_states",
                    "timestep", "audio_timestep", "sigma", "encoder_attention_mask", "audio_encoder_attention_mask",
                    "video_coords", "audio_coords", "perturbation_mask"),
        # the video stream after block 0's timestep modulation (the first 6 modulation rows' shift/scale)
        modulated_input=_modulated_input,
        num_heads=model.config.num_attention_heads, tp_plan=tp_plan(model), sp_plan=sp_plan(model),
        cache_defaults={"tea_cache": TEACACHE_DEFAULTS, "cache_dit": CACHE_DIT_DEFAULTS})


def sp_plan(model: Any) -> dict:
    """Sequence parallelism: the video tokens sharded after their input projection, and the per-token inputs the
    forward hands every block (the rotary tables, ``[B, H, S, d]`` for split RoPE; the modulation, per token in
    image-to-video, per row and kept whole otherwise) at each block; gathered before the output norm (whose
    modulation may be per token). The audio stays whole on every rank (:mod:`omni_model_ltx2.attention`)."""
    rope = 2 if model.config.rope_type == "split" else 1
    return {"shard_after": {"proj_in": 1},
            "shard_before": {"transformer_blocks.*": {
                "temb": 1, "temb_ca_scale_shift": 1, "temb_ca_gate": 1, "temb_prompt": 1,
                "video_rotary_emb": rope, "ca_video_rotary_emb": rope}},
            "gather_before": {"norm_out": 1}, "gather": None}


def tp_plan(model: Any) -> dict:
    """Tensor parallelism: the six attentions of every block by heads (their QK RMSNorms span all heads: split
    with an all-reduced mean of squares), both feed-forwards by hidden units."""
    from omni_core.distributed.tensor_parallel import attention_layers, feed_forward_layers

    plan: dict = {}
    for attr in ("attn1", "audio_attn1", "attn2", "audio_attn2", "audio_to_video_attn", "video_to_audio_attn"):
        plan.update(attention_layers(f"transformer_blocks.*.{attr}", norms_across_heads=("norm_q", "norm_k")))
    plan.update(feed_forward_layers("transformer_blocks.*.ff"))
    plan.update(feed_forward_layers("transformer_blocks.*.audio_ff"))
    return plan


def _modulated_input(module: Any, block: Any, args: dict) -> torch.Tensor:
    """Block 0's video input after its first timestep modulation (``norm1(x) * (1 + scale_msa) + shift_msa``),
    per row: TeaCache's signal."""
    x, temb = args["hidden_states"], args["temb"]
    shift, scale = block.get_mod_params(block.scale_shift_table, temb, x.shape[0])[:2]
    return block.norm1(x) * (1 + scale) + shift

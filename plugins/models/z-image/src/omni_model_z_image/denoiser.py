"""What accelerators see of Z-Image's transformer: the batched denoiser module and its ``DenoiserSpec`` (main
blocks, per-row side inputs, TeaCache's signal, the sequence-parallel plan)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from omni_core.pipelines.denoiser import DenoiserSpec

#: the block signature of ``ZImageTransformerBlock.forward``
BLOCK_PARAMS = ("x", "attn_mask", "freqs_cis", "adaln_input", "noise_mask", "adaln_noisy", "adaln_clean")


def modulated_input(module: Any, block: Any, a: dict) -> torch.Tensor:
    """TeaCache's signal: block 0's attention input, ``attention_norm1(x) * (1 + scale_msa)``, as the block
    computes it."""
    scale_msa = block.adaLN_modulation(a["adaln_input"]).unsqueeze(1).chunk(4, dim=2)[0]
    return block.attention_norm1(a["x"]) * (1.0 + scale_msa)


def sp_plan(num_layers: int, final_layer: str) -> dict:
    """Sequence parallelism over the main layers: each row's unified ``[image, text]`` sequence (padded to the
    call's longest, masked) is sharded on its token dim where block 0 takes it, and the final layer's output
    is gathered. The forward builds the rotary table and the mask inline and hands the same full tensors to
    every block, so each block's ``freqs_cis`` and ``attn_mask`` are sharded at its own call (the plan has no
    "every block of a list" form). The refiners before block 0 run on whole sequences on every rank."""
    side = {"attn_mask": 1, "freqs_cis": 1}
    shard = {f"transformer.layers.{i}": ({"x": 1, **side} if i == 0 else side) for i in range(num_layers)}
    return {"shard_before": shard, "gather_after": {final_layer: 1}, "gather_output": None}


class ZImageDenoiser(torch.nn.Module):
    """The transformer as accelerators see a denoiser: diffusers' ``ZImageTransformer2DModel`` takes and returns
    lists of per-sample tensors (it pads and masks inside); this calls it the way diffusers' pipeline does
    (latents ``[B, C, 1, h, w]`` unbound into a list, the outputs stacked), so a call's output is one batch
    tensor that caches can split and join by rows. ``layers`` are the transformer's own main blocks."""

    def __init__(self, transformer: torch.nn.Module) -> None:
        super().__init__()
        self.transformer = transformer

    @property
    def layers(self) -> torch.nn.ModuleList:
        return self.transformer.layers

    def cache_context(self, name: str) -> Any:
        """diffusers' cache-hook context when the transformer has one (``CacheMixin``); else nothing."""
        inner = getattr(self.transformer, "cache_context", None)
        return inner(name) if inner is not None else contextlib.nullcontext()

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, cap_feats: list,
                return_dict: bool = False) -> tuple[torch.Tensor]:
        out = self.transformer(list(hidden_states.unbind(0)), timestep, list(cap_feats), return_dict=False)[0]
        return (torch.stack(out),)


def tp_plan(transformer: Any) -> dict:
    """Tensor parallelism over the main layers and both refiners: attention by heads, the SwiGLU MLP by hidden
    units, the adaLN modulations (where a block has one) split with their outputs gathered."""
    from omni_core.distributed.tensor_parallel import attention_layers, feed_forward_layers

    plan: dict = {}
    for stack in ("layers", "noise_refiner", "context_refiner"):
        path = f"transformer.{stack}.*"
        plan.update(attention_layers(f"{path}.attention"))
        plan.update(feed_forward_layers(f"{path}.feed_forward", first=("w1", "w3"), last="w2"))
        if getattr(getattr(transformer, stack)[0], "modulation", False):
            plan[f"{path}.adaLN_modulation.0"] = "colwise_gather"
    return plan


def denoiser_spec(module: ZImageDenoiser) -> DenoiserSpec:
    """The spec of ``module`` (a :class:`ZImageDenoiser`): the main ``layers`` (the refiners run inside the
    forward before block 0), ``x`` carried, the mask, rotary table and timestep embedding per row."""
    t = module.transformer
    cfg = t.config
    final = f"transformer.all_final_layer.{cfg.all_patch_size[0]}-{cfg.all_f_patch_size[0]}"
    return DenoiserSpec(
        name="transformer", module=module, blocks_attr="layers",
        block_params=BLOCK_PARAMS, carried="x", block_outputs="x", residual_stream="x",
        side_inputs=("attn_mask", "freqs_cis", "adaln_input"),
        batch_args=("hidden_states", "timestep", "cap_feats"),
        modulated_input=modulated_input,
        num_heads=cfg.n_heads, num_kv_heads=cfg.n_kv_heads,
        sp_plan=sp_plan(len(t.layers), final), tp_plan=tp_plan(t),
        # no TeaCache coefficients are published for Z-Image: tea_cache uses the raw relative change unless
        # cache_config gives some (or `omni cache calibrate --write` ships them in the folder)
        cache_defaults={})

"""The declared tensor-parallel plan on the released FLUX.2 [dev] transformer config (built on ``meta``: no memory):
every pattern resolves, every segment adds up and divides by 2, and a TP-2 rank holds about half the parameter
bytes (the tiny test model is dominated by its embedders, so the share is checked here; the two-process equality
is ``test_parallel.py``'s)."""

from __future__ import annotations

#: FLUX.2 [dev]'s ``transformer/config.json`` (black-forest-labs/FLUX.2-dev; diffusers' defaults are the same)
DEV_CONFIG = dict(patch_size=1, in_channels=128, num_layers=8, num_single_layers=48, attention_head_dim=128,
                  num_attention_heads=48, joint_attention_dim=15360, timestep_guidance_channels=256, mlp_ratio=3.0,
                  axes_dims_rope=(32, 32, 32, 32), rope_theta=2000, eps=1e-6, guidance_embeds=True)


def test_each_tp2_rank_holds_about_half_of_the_dev_transformer():
    import torch
    from diffusers import Flux2Transformer2DModel

    from omni_core.distributed.tensor_parallel import TensorParallelPlan, param_shards
    from omni_model_flux2.pipeline import TP_PLAN

    with torch.device("meta"):
        model = Flux2Transformer2DModel(**DEV_CONFIG)
    layers = TensorParallelPlan.coerce(TP_PLAN).resolve(model)
    shards = param_shards(model, layers, 2)
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    split = sum(model.get_parameter(p).numel() * model.get_parameter(p).element_size() for p in shards)
    held = (full - split / 2) / full
    print(f"FLUX.2 [dev] TP-2: a rank holds {held:.3f} of {full / 2**30:.1f} GiB (float32)")
    assert 0.5 <= held <= 0.51, held  # 0.504: the embedders, norm_out and proj_out stay whole
    # the fused single-stream projection is split part by part: [q | k | v | gate | up] of 6144 x 3 and 18432 x 2
    fused = shards["single_transformer_blocks.0.attn.to_qkv_mlp_proj.weight"]
    assert fused.segments == (6144, 6144, 6144, 18432, 18432)
    assert shards["single_transformer_blocks.0.attn.to_out.weight"].segments == (6144, 18432)
    assert shards["transformer_blocks.0.ff.linear_in.weight"].segments == (18432, 18432)

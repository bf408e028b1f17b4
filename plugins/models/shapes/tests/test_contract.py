"""shapes passes the core's pipeline contract and declares its denoiser (spec, SP plan, TeaCache defaults)."""

from __future__ import annotations

import torch

from omni_core.testing.driver import make_state, run_step_batch
from omni_core.testing.pipeline_contract import PipelineContract


class TestShapesPipelineContract(PipelineContract):
    model = "shapes"
    sampling = {"num_inference_steps": 4}
    # one torch thread per engine, as the one_torch_thread fixture (and flux, flux2, z-image, ltx2, hunyuan-video15):
    # at its default budget (2 on a 2-core machine) a one-image wave beside other jobs took 3-4 s instead of 0.1 s,
    # OpenMP's team waiting at every op for a descheduled thread; the default budget and its contention gauge are
    # the core's to test (tests/runtime/test_thread_policy.py, test_lanes.py)
    engine_kwargs = {"warmup": False, "cpu_threads": 1}
    stages_check = False  # the stages apart: tests/runtime/test_stages.py (both modes, more requests)


def test_declares_its_transformer(shapes_pipeline):
    from omni_core.attention.parallel.plan import SequenceParallelPlan
    from omni_core.pipelines.denoiser import denoisers_of

    (spec,) = denoisers_of(shapes_pipeline)
    assert spec.module is shapes_pipeline.transformer and spec.blocks is shapes_pipeline.transformer.blocks
    spec.check_block_signature()  # the declared block parameters are the real ones
    assert isinstance(spec.sp_plan, SequenceParallelPlan) and spec.sp_plan.shard_outputs == {"x_embed": 1}
    assert not hasattr(shapes_pipeline.transformer, "_sp_plan")  # the plan lives in the spec only
    assert spec.num_heads == shapes_pipeline.transformer.config.num_heads
    tea = spec.defaults_for("tea_cache")
    assert len(tea["coefficients"]) == 5 and tea["rel_l1_thresh"] == 0.03 and tea["warmup_steps"] == 1


def test_batch_args_and_modulated_input_match_the_model(shapes_pipeline):
    import inspect

    from omni_core.pipelines.denoiser import denoisers_of

    (spec,) = denoisers_of(shapes_pipeline)
    assert set(spec.batch_args) <= set(inspect.signature(shapes_pipeline.transformer.forward).parameters)
    seen = {}
    block0 = spec.blocks[0]
    hooks = [block0.register_forward_pre_hook(lambda m, a: seen.setdefault("args", a)),
             block0.attn1.register_forward_pre_hook(lambda m, a: seen.setdefault("attn_in", a[0]))]
    try:
        run_step_batch(shapes_pipeline, [make_state(shapes_pipeline, "a red circle in the center", seed=0,
                                                    num_inference_steps=1)])
    finally:
        for h in hooks:
            h.remove()
    args = dict(zip(spec.block_params, seen["args"]))
    assert torch.equal(spec.modulated_input(spec.module, block0, args), seen["attn_in"])


def test_each_call_carries_the_typed_context(shapes_pipeline):
    """Cache backends read which rows belong to which request and branch from ``forward_context().call``."""
    from omni_core.forward_context import forward_context

    p = shapes_pipeline
    calls = []
    hook = p.transformer.register_forward_pre_hook(lambda m, a: calls.append((forward_context().call, a[0].shape[0],
                                                                              a[3])))
    try:
        states = [make_state(p, "a red circle in the center", seed=1, num_inference_steps=1, num_outputs_per_prompt=2),
                  make_state(p, "a blue square in the top left", seed=2, num_inference_steps=1, guidance_scale=1.0)]
        run_step_batch(p, states)
    finally:
        hook.remove()
    (call, batch, mask), = calls
    assert call.covers(batch) and call.expert == "transformer"
    assert [(g.state, g.rows, g.branch) for g in call.groups] == [(states[0], 2, "cond"), (states[1], 1, "cond"),
                                                                   (states[0], 2, "uncond")]
    assert call.text_mask is mask and call.text_mask.shape[0] == batch
    assert forward_context().call is None  # nothing leaks out of the call

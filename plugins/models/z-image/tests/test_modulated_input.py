"""Z-Image's declared ``modulated_input`` (TeaCache's signal) is exactly what block 0 of the transformer feeds
its attention: ``attention_norm1(x) * (1 + scale_msa)`` with ``scale_msa`` the first of the four chunks of the
block's own ``adaLN_modulation``. Checked against the tensor the real block hands its attention module during
a denoiser call (a guided request, so two rows), not against a re-derivation of the formula."""

from __future__ import annotations

import torch

from omni_core.pipelines.denoiser import denoisers_of
from omni_core.testing.driver import make_state


def test_declared_signal_is_block0s_attention_input(omni_zimage):
    (spec,) = denoisers_of(omni_zimage)
    block0 = spec.blocks[0]
    seen: list[tuple[dict, torch.Tensor]] = []
    inputs: dict = {}

    def on_block0(module, args, kwargs):
        inputs.clear()
        inputs.update(zip(spec.block_params, args))
        inputs.update({k: v for k, v in kwargs.items() if k in spec.block_params})

    def on_attention(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        seen.append((dict(inputs), hidden.detach().clone()))

    hooks = [block0.register_forward_pre_hook(on_block0, with_kwargs=True),
             block0.attention.register_forward_pre_hook(on_attention, with_kwargs=True)]
    try:
        omni_zimage.forward([make_state(omni_zimage, "a red fox in the snow", seed=3, negative_prompt="blurry",
                                        guidance_scale=3.0, height=32, width=32, num_inference_steps=2)])
    finally:
        for h in hooks:
            h.remove()
    assert len(seen) == 2, f"block 0 ran {len(seen)} times in 2 steps (one batched call per step expected)"
    for bound, attention_input in seen:
        assert attention_input.shape[0] == 2  # the cond and uncond rows
        with torch.no_grad():
            signal = spec.modulated_input(spec.module, block0, bound)
        torch.testing.assert_close(signal, attention_input, atol=1e-6, rtol=0,
                                   msg=lambda m: f"modulated_input is not block 0's attention input: {m}")

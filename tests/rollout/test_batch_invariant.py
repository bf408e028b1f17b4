"""``batch_invariant=True`` (issue #52): a request alone and the same request inside a wave of eight (other prompts
of other lengths, other step counts, arriving at other steps, CFG on for some) give the same bits: image, rollout
latents and log-probabilities, ``torch.equal``, in step mode, on shapes and tiny FLUX.1, Wan and Qwen-Image."""

from __future__ import annotations

import threading

import torch


def _request(prompt: str, seed: int, steps: int, size: dict, guidance: float | None):
    from omni_core.config import SamplingParams
    from omni_core.request import OmniDiffusionRequest

    extra = {} if guidance is None else {"guidance_scale": guidance}
    return OmniDiffusionRequest(prompt=prompt, negative_prompt="blurry" if guidance else None,
                                sampling_params=SamplingParams(
                                    seed=seed, num_inference_steps=steps, output_type="pt", **size, **extra,
                                    rollout={"sde_type": "sde", "trajectory": True}))


def test_a_request_alone_equals_itself_in_a_staggered_wave_of_eight(case):
    from omni_core import Omni
    from omni_core.testing.contract_helpers import final_output

    name, folder, _, size = case
    target = ("a red circle in the top left corner", 11, 4)
    others = [("a cat", 1, 3), ("a long and winding road through green hills at dawn, photographed", 2, 5),
              ("x", 3, 4), ("two blue squares", 4, 6), ("a dog on a beach under a very cloudy sky", 5, 2),
              ("night", 6, 4), ("a green triangle above a yellow one", 7, 3)]
    with Omni(folder, warmup=False, cpu_threads=1, step_execution=True, max_num_seqs=8,
              batch_invariant=True) as omni:
        engine = omni.engine
        (alone,) = [final_output(h) for h in engine.submit([_request(*target, size, None)])]
        late: list = []
        started = threading.Event()

        def join(rid: str, step: int, total: int) -> None:  # the target arrives once the wave is at step 1
            if step >= 1 and not started.is_set():
                started.set()
                late.extend(engine.submit([_request(*target, size, None)]))

        first = engine.submit([_request(*o, size, 4.0 if i % 2 else None) for i, o in enumerate(others[:4])],
                              on_progress=join)
        rest = engine.submit([_request(*o, size, None) for o in others[4:]])
        outs = [final_output(h) for h in [*first, *rest]]
        assert started.wait(60)
        inside = final_output(late[0])
    assert all(o.status == "completed" for o in [*outs, inside, alone])
    assert torch.equal(inside.tensor, alone.tensor)
    assert torch.equal(inside.rollout["log_probs"], alone.rollout["log_probs"])
    assert torch.equal(inside.rollout["latents"], alone.rollout["latents"])

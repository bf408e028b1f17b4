"""Tier 2: a family diffusers offers as a modular pipeline runs in step mode through its blocks: requests
arriving at different steps (one joining a running wave) each equal the request-mode output (the pipeline's own
call) bit for bit, on FLUX.1 and Wan; previews stream per step; a family without modular blocks refuses step mode
naming the option."""

from __future__ import annotations

import pytest
import torch

from omni_model_diffusers.parity import omni_fields
from omni_model_diffusers.testing import FAMILIES


@pytest.mark.parametrize("name", ["flux", "wan"])
def test_step_mode_with_staggered_arrivals_equals_request_mode(family, name):
    import threading

    from omni_core import Omni
    from omni_core.config import SamplingParams
    from omni_core.request import OmniDiffusionRequest
    from omni_core.testing.contract_helpers import final_output

    fields = {**omni_fields(FAMILIES[name].call_kwargs), "num_inference_steps": 4}
    prompts, seeds = ["a cat", "a red car on a long street at night"], [5, 6]
    with Omni(family(name), pipeline="diffusers", warmup=False, cpu_threads=1) as omni:
        alone = [omni.generate(p, seed=s, output_type="pt", use_tqdm=False, **fields)[0] for p, s in zip(prompts, seeds)]
    with Omni(family(name), pipeline="diffusers", warmup=False, cpu_threads=1, step_execution=True,
              max_num_seqs=2) as omni:
        assert omni.engine.mode.mode.value == "step_batch"
        second: list = []
        joined = threading.Event()

        def join_late(rid: str, step: int, total: int) -> None:  # the second request arrives at step 2
            if step == 2 and not joined.is_set():
                joined.set()
                req = OmniDiffusionRequest(prompt=prompts[1], sampling_params=SamplingParams(
                    seed=seeds[1], output_type="pt", **fields))
                second.extend(omni.engine.submit([req]))

        first = OmniDiffusionRequest(prompt=prompts[0], sampling_params=SamplingParams(
            seed=seeds[0], output_type="pt", **fields))
        (handle,) = omni.engine.submit([first], on_progress=join_late)
        outs = [final_output(handle), final_output(second[0])]
    for out, ref in zip(outs, alone):
        assert out.status == "completed" and torch.equal(out.images[0], ref.images[0])


def test_a_preempted_request_resumes_where_it_stopped(family):
    """Step mode keeps each request's modular run (its PipelineState, scheduler and guider) on its step state: a
    more urgent request that preempts it (one slot) runs first, and both then equal request mode bit for bit."""
    from omni_core import Omni
    from omni_core.config import SamplingParams
    from omni_core.request import OmniDiffusionRequest
    from omni_core.testing.contract_helpers import final_output

    fields = {**omni_fields(FAMILIES["flux"].call_kwargs), "num_inference_steps": 6}
    with Omni(family("flux"), pipeline="diffusers", warmup=False, cpu_threads=1) as omni:
        alone = [omni.generate(p, seed=s, output_type="pt", use_tqdm=False, **fields)[0].images[0]
                 for p, s in (("a cat", 1), ("a dog", 2))]
    with Omni(family("flux"), pipeline="diffusers", warmup=False, cpu_threads=1, step_execution=True,
              max_num_seqs=1) as omni:
        urgent: list = []

        def preempt_at_2(rid: str, step: int, total: int) -> None:
            if step == 2 and not urgent:
                urgent.extend(omni.engine.submit([OmniDiffusionRequest(prompt="a dog", sampling_params=SamplingParams(
                    seed=2, output_type="pt", priority=-1, **fields))]))

        (low,) = omni.engine.submit([OmniDiffusionRequest(prompt="a cat", sampling_params=SamplingParams(
            seed=1, output_type="pt", priority=5, **fields))], on_progress=preempt_at_2)
        outs = [final_output(low), final_output(urgent[0])]
        assert omni.stats()["requests_preempted"] >= 1
    assert torch.equal(outs[0].images[0], alone[0]) and torch.equal(outs[1].images[0], alone[1])


def test_a_family_without_modular_blocks_refuses_step_mode(family):
    from omni_core import Omni
    from omni_core.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        Omni(family("sd"), pipeline="diffusers", warmup=False, step_execution=True)
    assert err.value.field == "step_execution"


@pytest.mark.parametrize("name", ["flux", "wan"])
def test_stages_apart_equal_in_line(family, name):
    """``encode_workers=1, decode_workers=1`` in step mode: the text blocks run in the encode process (it alone
    holds the text encoders), the blocks after the loop in the decode process (the VAE), and every request of a wave
    of two equals the same engine in line and the pipeline's own call for that request alone, bit for bit."""
    from omni_core import Omni
    from omni_core.config import SamplingParams

    fields = {**omni_fields(FAMILIES[name].call_kwargs), "num_inference_steps": 3}
    prompts = ["a cat", "a red car on a long street at night"]
    params = [SamplingParams(seed=s, output_type="pt", **fields) for s in (5, 6)]
    outs = {}
    with Omni(family(name), pipeline="diffusers", warmup=False, cpu_threads=1, max_num_seqs=1) as omni:
        outs["request"] = omni.generate(prompts, sampling_params=params, use_tqdm=False)  # a call each
    for apart in (0, 1):
        with Omni(family(name), pipeline="diffusers", warmup=False, cpu_threads=1, step_execution=True,
                  max_num_seqs=2, encode_workers=apart, decode_workers=apart) as omni:
            outs[apart] = omni.generate(prompts, sampling_params=params, use_tqdm=False)
            if apart:
                stages = omni.engine.stats()["stages"]
                assert set(stages["encode"]["model_bytes"]) == {"text_encoder", "text_encoder_2"} if name == "flux" \
                    else {"text_encoder"}, stages
                assert set(stages["decode"]["model_bytes"]) == {"vae"}, stages
    for apart, want in zip(outs[1], outs["request"]):
        assert torch.equal(*((o.images[0] if o.images else o.video) for o in (apart, want)))
    for inline, want in zip(outs[0], outs["request"]):
        assert torch.equal(*((o.images[0] if o.images else o.video) for o in (inline, want)))


def test_stages_apart_in_request_mode_are_refused_naming_step_execution(family):
    from omni_core import Omni
    from omni_core.errors import OmniError

    with pytest.raises(OmniError) as err:
        Omni(family("flux"), pipeline="diffusers", warmup=False, decode_workers=1)
    assert "decode_workers" in str(err.value) and "step_execution=True" in str(err.value)

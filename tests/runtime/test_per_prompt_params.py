"""``Omni.generate(prompts, [sp1, sp2, ...])``: vLLM's one-``SamplingParams``-per-prompt convention (issue #37), next to
one ``SamplingParams`` for all; ``AsyncOmni.generate`` takes a list of one."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from omni_core import AsyncOmni, Omni
from omni_core.config import SamplingParams
from omni_core.errors import ConfigError

PROMPTS = ["a red circle", "a blue square", {"prompt": "a green cross", "negative_prompt": "blurry"}]
#: two that may share a wave (same size, steps and scale; their own seeds) and one that cannot
PARAMS = [SamplingParams(seed=1, guidance_scale=3.0), {"seed": 2, "guidance_scale": 3.0},
          SamplingParams(seed=3, num_inference_steps=3, height=24, width=24, guidance_scale=1.5)]


def pixels(out):
    return np.stack([np.asarray(im, dtype=np.int16) for im in out.images])


@pytest.fixture(scope="module")
def omni(tiny_model):
    with Omni(tiny_model, max_num_seqs=4, warmup=False) as engine:
        yield engine


def test_one_sampling_params_per_prompt_equals_each_prompt_run_alone(omni):
    together = omni.generate(PROMPTS, PARAMS, use_tqdm=False)
    alone = [omni.generate(p, sp, use_tqdm=False)[0] for p, sp in zip(PROMPTS, PARAMS)]
    assert [o.metrics["seed"] for o in together] == [1, 2, 3]
    assert together[2].images[0].size == (24, 24) and together[2].metrics["steps_run"] == 3
    for a, b in zip(together, alone):
        assert np.array_equal(pixels(a), pixels(b))
    assert together[0].metrics["batch_size"] == 2  # the two compatible prompts still shared a wave
    assert not np.array_equal(pixels(together[0]), pixels(together[1]))


def test_a_tuple_works_and_keywords_apply_to_every_prompt(omni):
    outs = omni.generate(PROMPTS[:2], (SamplingParams(seed=5), None), num_inference_steps=2, use_tqdm=False)
    assert [o.metrics["steps_run"] for o in outs] == [2, 2] and outs[0].metrics["seed"] == 5


@pytest.mark.parametrize("params, message", [
    ([SamplingParams(), SamplingParams()], "is a list of 2, but there are 3 prompts"),
    ([SamplingParams(), 5, None], r"sampling_params\[1\]: sampling_params must be SamplingParams"),
    ([SamplingParams(), [SamplingParams()], None], r"sampling_params\[1\] is a list"),
])
def test_a_wrong_list_is_refused_naming_the_field(omni, params, message):
    with pytest.raises(ConfigError, match=message) as info:
        omni.generate(PROMPTS, params, use_tqdm=False)
    assert info.value.field == "sampling_params"


def test_a_bad_value_in_one_entry_names_its_field(omni):
    with pytest.raises(ConfigError) as info:
        omni.generate(PROMPTS, [SamplingParams(), {"num_inference_steps": 0}, None], use_tqdm=False)
    assert info.value.field == "num_inference_steps"


def test_async_omni_takes_a_list_of_one(tiny_model, omni):
    async def run():
        async with AsyncOmni(tiny_model, warmup=False) as engine:
            outs = [o async for o in engine.generate(PROMPTS[0], [PARAMS[0]])]
            with pytest.raises(ConfigError, match="is a list of 2, but there is 1 prompt"):
                async for _ in engine.generate(PROMPTS[0], PARAMS[:2]):
                    pass
            with pytest.raises(ConfigError, match="takes one prompt, got a list of 2"):
                async for _ in engine.generate(PROMPTS[:2], PARAMS[:2]):
                    pass
            return outs[-1]

    final = asyncio.run(run())
    assert np.array_equal(pixels(final), pixels(omni.generate(PROMPTS[0], PARAMS[0], use_tqdm=False)[0]))

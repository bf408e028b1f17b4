"""Ulysses-2, Ring-2 and tensor parallel 2 (two gloo processes) give what one process gives, by the spec's sp_plan
and tp_plan alone."""

import pytest
import torch

from omni_core import Omni

pytestmark = pytest.mark.dist


def generate(parallel_config: dict, **engine):
    with Omni("toy", warmup=False, dtype="float32", max_num_seqs=2, parallel_config=parallel_config,
              **engine) as omni:
        pair = omni.generate([{"prompt": "a red fox in the snow", "negative_prompt": "blurry"}, "a cat"],
                             seed=1, num_inference_steps=4, use_tqdm=False, output_type="pt")
        # 7 x 9 = 63 tokens: not a multiple of 2, so the plan pads and strips
        odd = omni.generate("two ships", seed=2, height=14, width=18, guidance_scale=1.0,
                            num_inference_steps=4, use_tqdm=False, output_type="pt")
    return pair + odd


@pytest.fixture(scope="module")
def one_process():
    return generate({})


@pytest.mark.parametrize("parallel_config,engine", [({"ulysses_degree": 2}, {}),
                                                    ({"ring_degree": 2}, {"step_execution": True}),
                                                    ({"tensor_parallel_size": 2}, {})],
                         ids=["ulysses2", "ring2", "tp2"])
def test_sequence_parallel_equals_one_process(one_process, parallel_config, engine):
    for ref, out in zip(one_process, generate(parallel_config, **engine)):
        assert (out.images[0] - ref.images[0]).abs().max().item() <= 1e-5
        assert out.metrics["communication_bytes"] > 0  # the ranks really split the tokens (or the layers)

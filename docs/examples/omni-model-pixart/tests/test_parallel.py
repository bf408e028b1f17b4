"""What the record's ``supported_parallel`` claims: Ulysses-2, Ring-2 and CFG-2 (two gloo processes) give what one
process gives, by the spec's ``sp_plan`` and the base class's CFG split alone."""

import pytest

from omni_core import Omni

pytestmark = pytest.mark.dist

SAMPLING = {"num_inference_steps": 3, "max_sequence_length": 64, "use_tqdm": False, "output_type": "pt"}


def generate(folder: str, parallel_config: dict, **engine):
    with Omni(folder, warmup=False, dtype="float32", max_num_seqs=2, parallel_config=parallel_config,
              **engine) as omni:
        pair = omni.generate([{"prompt": "a red fox in the snow", "negative_prompt": "blurry"}, "a cat"], seed=1,
                             height=16, width=16, **SAMPLING)
        # 12 x 20 pixels: 3 x 5 = 15 image tokens, not a multiple of 2, so the plan pads and strips
        odd = omni.generate("two ships", seed=2, height=12, width=20, guidance_scale=1.0, **SAMPLING)
    return pair + odd


@pytest.fixture(scope="module")
def one_process(pixart_dir):
    return generate(pixart_dir, {})


@pytest.mark.parametrize("parallel_config,engine", [({"ulysses_degree": 2}, {}),
                                                    ({"ring_degree": 2}, {"step_execution": True}),
                                                    ({"cfg_parallel_size": 2}, {})],
                         ids=["ulysses2", "ring2", "cfg2"])
def test_parallel_equals_one_process(pixart_dir, one_process, parallel_config, engine):
    outs = generate(pixart_dir, parallel_config, **engine)
    for ref, out in zip(one_process, outs):
        assert (out.images[0] - ref.images[0]).abs().max().item() <= 1e-5
    assert outs[0].metrics["communication_bytes"] > 0  # the ranks really split the work

"""tea_cache under Ulysses sequence parallelism: each rank sees half the tokens, the change statistic is summed
over the sp group, so both ranks take the single-process decisions and produce its images."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def qwen4_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from omni_model_qwen_image.testing import build_tiny_qwen_image

    return build_tiny_qwen_image(tmp_path_factory.mktemp("tea-qwen4h"), num_layers=2, num_heads=4)


def test_ulysses_ranks_agree_with_one_process(qwen4_dir):
    from omni_core import Omni

    prompts = [{"prompt": "a red fox jumps over a lazy dog", "negative_prompt": "blurry"},
               {"prompt": "a cat", "negative_prompt": "low quality"}]
    kw = dict(seed=4, height=32, width=32, num_inference_steps=8, use_tqdm=False, output_type="pt")
    outs = {}
    for label, pc in (("one", {}), ("ulysses2", {"ulysses_degree": 2})):
        with Omni(qwen4_dir, dtype="float32", warmup=False, max_num_seqs=2, parallel_config=pc,
                  cache_backend="tea_cache", cache_config={"rel_l1_thresh": 0.45}) as omni:
            outs[label] = omni.generate(prompts, **kw)
    for one, sp in zip(outs["one"], outs["ulysses2"]):
        assert sp.metrics["cache_branches"] == one.metrics["cache_branches"]
        assert "R" in one.metrics["cache_branches"]["cond/transformer"]["pattern"]
        torch.testing.assert_close(sp.images[0], one.images[0], atol=1e-5, rtol=0)


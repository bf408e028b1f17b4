"""cache_dit under Omni's sequence parallelism is refused at start-up (its decisions are not agreed across ranks);
under CFG parallelism each branch's context decides on its own rank exactly as in one process (issue #35)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def qwen4_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from omni_model_qwen_image.testing import build_tiny_qwen_image

    return build_tiny_qwen_image(tmp_path_factory.mktemp("dit-qwen4h"), num_layers=2, num_heads=4)


def test_cache_dit_refuses_sequence_parallelism(qwen4_dir):
    from omni_core import Omni
    from omni_core.errors import OmniError

    # refused by the core's table of combinations (omni_core/combinations.py), before any worker starts
    with pytest.raises(OmniError, match=r"cache_backend='cache_dit' cannot be combined with "
                                        r"parallel_config\.ulysses_degree > 1"):
        Omni(qwen4_dir, dtype="float32", warmup=False, parallel_config={"ulysses_degree": 2},
             cache_backend="cache_dit")


#: the combination matrix's cache_dit config: on this tiny model the cond and uncond branches' residual diffs lie
#: on either side of the threshold at step 2, so a decision from anything but the branch's own diff changes the image
CACHE = {"residual_diff_threshold": 0.5, "max_warmup_steps": 2}


def _one_request(model: str, **options):
    from omni_core import Omni

    with Omni(model, dtype="float32", warmup=False, cache_backend="cache_dit", cache_config=CACHE, **options) as omni:
        prompt = {"prompt": "a red fox jumping over a lazy dog", "negative_prompt": "blurry, low quality"}
        (out,) = omni.generate(prompt, seed=1, height=32, width=32, num_inference_steps=6, true_cfg_scale=4.0,
                               output_type="pt", use_tqdm=False)
    return out


def test_cfg_parallel_branches_decide_as_in_one_process(qwen4_dir):
    """Under cfg_parallel_size 2 rank 0 runs the cond branch and rank 1 the uncond one, each in its own cache-dit
    context; each must decide from its own Fn residual, as in one process. cache-dit all-reduced (averaged) the
    residual diff over the world whenever torch.distributed had several ranks, so each branch decided on the mean
    of both branches' diffs: the combination matrix's B+cfg vs B differed by 4.3e-3 on a lone CFG request
    (issue #35)."""
    one = _one_request(qwen4_dir)
    two = _one_request(qwen4_dir, parallel_config={"cfg_parallel_size": 2})
    cond, uncond = (one.metrics["cache_branches"][f"{b}/transformer"] for b in ("cond", "uncond"))
    assert cond["residual_diffs"] != uncond["residual_diffs"]  # a mean of the two would show
    # rank 0 reports its branch (cond): the same diffs, the same decisions, the same image as one process
    got = two.metrics["cache_branches"]["cond/transformer"]
    assert got["residual_diffs"] == pytest.approx(cond["residual_diffs"], abs=1e-4), (got, cond, uncond)
    assert got["cached_steps"] == cond["cached_steps"]
    assert two.metrics["communication_bytes"] > 0
    diff = float((two.images[0].float() - one.images[0].float()).abs().max())
    assert diff <= 1e-4, diff

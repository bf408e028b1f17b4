"""``compile=True`` with a cache backend gives what the same cache gives eagerly (issue #35): ``tea_cache``'s
hooks stand above the ``compile`` stage, so they run eagerly around each compiled block, and ``cache_dit``'s
cached stack runs the blocks through their chain below its stand-in, so the blocks it computes are the
compiled ones. Same decisions (``cache_branches``), images within 1e-4 (``test_compile.py``'s tolerance)."""

from __future__ import annotations

import pytest
import torch

from omni_core.hooks import hook_names

PROMPT = "a red circle in the top left"
#: backend -> (a config that reuses work on ``shapes`` in 8 steps, the hooks on a block, outermost first). tea_cache
#: reuses as often as ``max_consecutive_reuse`` lets it (decisions that no rounding difference can flip);
#: cache_dit's residual diffs here are 0.28, 0.51, 0.71, ..., well away from its threshold
CASES = {"tea_cache": ({"rel_l1_thresh": 1e6, "warmup_steps": 1, "max_consecutive_reuse": 2}, ["tea_cache", "compile"]),
         "cache_dit": ({"residual_diff_threshold": 0.6, "max_warmup_steps": 2}, ["cache_dit.stand_in", "compile"])}


def decisions(metrics: dict) -> dict:
    """Per branch what was computed and reused (cache_dit's residual diffs, rounded floats, left out)."""
    return {k: {n: v for n, v in b.items() if n != "residual_diffs"} for k, b in metrics["cache_branches"].items()}


def block_compiles(block) -> int:
    """Compiled versions dynamo holds for the block class's ``forward`` (0: it never ran compiled)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    return len(_debug_get_cache_entry_list(type(block).forward.__code__))


def generate(backend: str, config: dict, compile: bool):
    from omni_core import Omni

    # a fixed thread count: dynamo guards on it (test_compile.py)
    with Omni("shapes", compile=compile, cache_backend=backend, cache_config=config, executor="uni", cpu_threads=1,
              warmup=False) as omni:
        (out,) = omni.generate(PROMPT, seed=3, num_inference_steps=8, output_type="pt", use_tqdm=False)
        pipeline = omni.engine.executor.runner.pipeline
        block = pipeline.denoisers()[0].blocks[0]
        seen = {"hooks": hook_names(block), "compiled": block_compiles(block),
                "failed": getattr(getattr(pipeline, "omni_compile", None), "failed", None)}
    assert out.status == "completed", out.error
    return out, seen


@pytest.mark.parametrize("backend", CASES)
def test_compile_with_a_cache_matches_the_cache_eagerly(backend):
    config, hooks = CASES[backend]
    torch._dynamo.reset()
    eager, _ = generate(backend, config, compile=False)
    compiled, seen = generate(backend, config, compile=True)
    assert seen["hooks"] == hooks and seen["failed"] is None
    assert seen["compiled"] >= 1, f"{backend}: the blocks never ran compiled"
    assert eager.metrics["steps_reused"] > 0, f"{backend} reused nothing: the combination was not exercised"
    assert decisions(compiled.metrics) == decisions(eager.metrics)
    torch.testing.assert_close(compiled.images[0], eager.images[0], atol=1e-4, rtol=0)

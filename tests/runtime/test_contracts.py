"""The tiny DiT of ``omni_core.testing`` passes the contract suites every model and cache plugin runs.

The cache contract runs only where a cache backend is installed (the core's own test run needs no plugin).
"""

from __future__ import annotations


import pytest

from omni_core.testing.cache_contract import CacheBackendContract
from omni_core.testing.pipeline_contract import PipelineContract


class TestTinyDiTPipelineContract(PipelineContract):
    model_fixture = "tiny_dit_model"
    sampling = {"num_inference_steps": 4}


class TestTinyDiTTeaCacheContract(CacheBackendContract):
    """Skipped where omni-cache-teacache is not installed."""

    cache_backend = "tea_cache"
    cache_config = {"rel_l1_thresh": 0.3}
    off_config = {"rel_l1_thresh": 0.0}


# ---------------------------------------------------------------------------- the suites catch broken plugins
class _LeakyBatchDiT:
    """Mixes rows: each request's velocity picks up a little of the batch mean (a request depends on its batch)."""

    @staticmethod
    def wrap(pipeline):
        original = pipeline.denoise_step

        def denoise_step(states):
            preds = original(states)
            mean = sum(p.mean() for p in preds) / len(preds)
            return [p + 1e-3 * mean for p in preds]

        pipeline.denoise_step = denoise_step
        return pipeline


class _SharedStateCache:
    """A cache that keeps one residual for the whole model instead of one per request: every other transformer
    call reuses the previous call's output, whoever it belonged to."""

    name = "shared_state"

    def __init__(self, config=None):
        self.enabled, self.calls, self.handle = False, 0, None

    def enable(self, pipeline):
        state = {"last": None}

        def hook(module, args, out):
            self.calls += 1
            if self.calls % 2 == 0 and state["last"] is not None and state["last"].shape == out.shape:
                return state["last"]
            state["last"] = out
            return out

        self.handle = pipeline.transformer.register_forward_hook(hook)
        self.enabled = True

    def disable(self, pipeline):
        self.handle.remove()
        self.enabled = False

    def is_enabled(self):
        return self.enabled

    def begin_request(self, state):
        state.cache_state["seen"] = True

    def request_metrics(self, state):
        return {"calls": self.calls}


def test_pipeline_contract_catches_a_pipeline_whose_requests_depend_on_the_batch(tiny_dit_model):
    from omni_core.testing._model import load_model

    suite = TestTinyDiTPipelineContract()
    with pytest.raises(AssertionError, match="alone vs in a request batch"):
        suite.test_alone_equals_batched_equals_staggered(_LeakyBatchDiT.wrap(load_model(tiny_dit_model)))


def test_cache_contract_catches_a_cache_that_shares_state_between_requests(tiny_dit_model):
    from omni_core.testing._model import load_model

    suite = TestTinyDiTTeaCacheContract()
    with pytest.raises(AssertionError, match="alone vs batched|joining a wave late"):
        suite.test_requests_are_independent_in_batches_and_step_waves(load_model(tiny_dit_model), _SharedStateCache)

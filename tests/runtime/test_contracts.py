"""The tiny DiT of ``omni_core.testing`` passes the contract suites every model and cache plugin runs.

The cache contract runs only where a cache backend is installed (the core's own test run needs no plugin).
"""

from __future__ import annotations


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

"""Ulysses-2, Ring-2, CFG-parallel-2 and tensor-parallel-2 on two gloo processes give what one process gives (max
abs diff 1e-5), by the DenoiserSpec's SP and TP plans and the core's CFG split alone. One spawn for all four
(spawning and importing torch/diffusers costs seconds, the checks milliseconds); the batch mixes CFG on and off, an
odd token count and a request with a reference image. The released [dev] config's TP-2 share is checked on
``meta`` in ``test_tensor_parallel.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from omni_core.distributed import spawn_workers

pytestmark = pytest.mark.dist

CONFIGS = [{"ulysses_degree": 2}, {"ring_degree": 2}, {"cfg_parallel_size": 2}, {"tensor_parallel_size": 2}]


def test_ulysses_ring_cfg_and_tensor_parallel_equal_one_process(klein_dir):
    results = spawn_workers(f"{Path(__file__).with_name('_dist_cases.py')}:worker", 2, (klein_dir, CONFIGS),
                            timeout=240)
    for rank, rows in enumerate(results):
        assert [r[0] for r in rows] == ["ulysses_degree=2", "ring_degree=2", "cfg_parallel_size=2",
                                     "tensor_parallel_size=2"]
        for label, diff, sent, held in rows:
            assert diff <= 1e-5, (rank, label, diff)
            assert sent > 0, (rank, label)  # the ranks really split the tokens (or the branches, or the layers)
            if label.startswith("tensor"):  # each rank holds its shards only (the tiny model's embedders stay whole)
                assert held < 0.75, (rank, label, held)
    print("max abs diff against one process:", results[0])

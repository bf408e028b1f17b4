"""Multi-process (gloo) checks: Ulysses, Ring, Ulysses x Ring, CFG and data parallel equal one process.

One spawn per world size runs every check inside the workers (spawning costs seconds, checks milliseconds):
the ``Attention`` layer on uneven lengths (37 tokens on 2 and 4 ranks, 3 tokens on 4), GQA, joint
text+image attention with the text replicated (text in front with a per-sample key-padding mask, and text
at the back), a key mask on the sharded tokens, cross-attention; three tiny transformers opted in through a
plan (one patchifies inside its forward, one builds its tokens inline like Wan); CFG-parallel guidance;
data-parallel replicas serving different requests. Every rank compares with the single-process result
of the same inputs.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from omni_core.distributed import spawn_workers

pytestmark = pytest.mark.dist

CASES = str(Path(__file__).with_name("_cases.py"))
TOL = 1e-5


def _check(results: list[list[tuple]], configs: list[dict]) -> None:
    labels = {", ".join(f"{k}={v}" for k, v in c.items()) for c in configs}
    for rank, rows in enumerate(results):
        assert {r[0] for r in rows} == labels, f"rank {rank} ran {sorted({r[0] for r in rows})}"
        diffs = [r for r in rows if not r[1].startswith("bytes")]
        bad = [r for r in diffs if not r[2] <= TOL]
        assert not bad, f"rank {rank}: results differ from one process by more than {TOL}: {bad}"
        assert len(diffs) >= 15 * len(configs)
        for label, name, nbytes in (r for r in rows if r[1].startswith("bytes")):
            # every model forward must really have run sharded (a plan that silently did nothing would still
            # match one process); CFG parallel communicates only in the CFG case, data parallel never
            sequence_parallel = "ulysses" in label or "ring" in label
            expected = sequence_parallel or ("cfg_parallel" in label and "CFG" in name)
            assert (nbytes > 0) == expected, (rank, label, name, nbytes)


def test_two_processes():
    configs = [{"ulysses_degree": 2}, {"ring_degree": 2}, {"cfg_parallel_size": 2}, {"data_parallel_size": 2}]
    _check(spawn_workers(f"{CASES}:worker", 2, (configs,), timeout=240), configs)


def test_four_processes():
    configs = [{"ulysses_degree": 4}, {"ring_degree": 4}, {"ulysses_degree": 2, "ring_degree": 2},
               {"ulysses_degree": 2, "cfg_parallel_size": 2}, {"ring_degree": 2, "data_parallel_size": 2}]
    _check(spawn_workers(f"{CASES}:worker", 4, (configs,), timeout=300), configs)


def _fail_on_rank_one(rank: int, world_size: int) -> None:
    import torch
    import torch.distributed as dist

    if rank == 1:
        raise RuntimeError("deliberate failure on rank 1")
    dist.all_reduce(torch.ones(1))  # rank 0 would wait here forever


def test_failing_rank_ends_the_others():
    with pytest.raises(Exception, match="deliberate failure on rank 1"):
        spawn_workers(f"{__file__}:_fail_on_rank_one", 2, timeout=60)


def test_plan_declared_in_a_denoiser_spec_is_applied_by_the_core():
    """What the worker does after ``load`` for every pipeline: the spec's ``sp_plan`` is installed (the module
    declares none itself) and the sharded forward equals one process, with tokens really exchanged."""
    configs = [{"ulysses_degree": 2}, {"ring_degree": 2}]
    results = spawn_workers(f"{CASES}:spec_worker", 2, (configs,), timeout=240)
    for rank, rows in enumerate(results):
        got = {(label, what): value for label, what, value in rows}
        for c in configs:
            label = ", ".join(f"{k}={v}" for k, v in c.items())
            assert got[(label, "installed")] == 1.0, (rank, label)
            assert got[(label, "max abs diff")] <= TOL, (rank, label, got[(label, "max abs diff")])
            assert got[(label, "bytes sent")] > 0, (rank, label)

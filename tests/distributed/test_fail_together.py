"""Ranks fail together (issue #36): an exception on one rank only -- an out-of-memory error on one GPU, say --
fails the call on every rank of the replica within the same wave, and every rank serves the next request.
Nothing waits for a timeout: without the agreement, the failing rank retried request by request while its peer
went on, their collectives stopped matching, and the ranks hung until the process group's timeout (NCCL's
watchdog tears every rank down after 120 s).

Two gloo ranks run a :class:`~omni_core.worker.runner.ModelRunner` each over a stub pipeline whose denoise step
holds a collective (as a sequence-parallel model's does) and raises on rank 1 for the request prompted ``bad``,
after that collective.

A failure *before* a collective its peer is already blocked in (the last test: cfg-2, rank 1 raises in its branch
before the all-gather) needs the process groups aborted and rebuilt on every rank
(``omni_core.distributed.recovery``); without that, the peer waits for the process-group timeout.
"""

from __future__ import annotations

import pytest

from omni_core.distributed import spawn_workers

pytestmark = pytest.mark.dist

#: seconds the whole check may take; every wave must end well inside the gloo timeout
TIMEOUT_S = 90


def _worker(rank: int, world_size: int, path: str) -> list[tuple]:
    import time

    import torch
    import torch.distributed as dist

    from omni_core.config import OmniDiffusionConfig, SamplingParams
    from omni_core.outputs import DiffusionOutput
    from omni_core.pipelines.base import OmniPipeline
    from omni_core.request import OmniDiffusionRequest
    from omni_core.waves import DiffusionSchedulerOutput
    from omni_core.worker.runner import ModelRunner

    class Stub(OmniPipeline):
        def __init__(self) -> None:
            pass

        def prepare_encode(self, state):
            state.num_steps = 2
            return state

        def denoise_step(self, states):
            x = torch.ones(len(states))
            dist.all_reduce(x)  # the step's collective
            if rank == 1 and any(s.request.prompt == "bad" for s in states):
                raise torch.OutOfMemoryError("CUDA out of memory (test: rank 1 only)")
            return list(x)

        def step_scheduler(self, state, pred):
            state.step_index += 1

        def post_decode(self, state):
            return DiffusionOutput(request_id=state.request_id, tensor=torch.zeros(1))

    runner = ModelRunner(OmniDiffusionConfig(model="shapes"), None, device=torch.device("cpu"),
                         dtype=torch.float32, rank=rank, world_size=world_size, stop_group=(None, 0, world_size))
    runner.pipeline = Stub()
    rows: list[tuple] = []

    def req(name):
        return OmniDiffusionRequest(prompt=name, request_id=f"{path}-{name}",
                                    sampling_params=SamplingParams(seed=0, num_inference_steps=2))

    def record(wave, result):
        rows.append((wave, {rid.split("-", 1)[1]: (o.status, o.finished, o.error or "")
                            for rid, o in result.outputs.items()}, sorted(runner.held_ids())))

    t0 = time.monotonic()
    if path == "request":
        record(1, runner.execute_batch(DiffusionSchedulerOutput(new_requests=[req("a"), req("bad"), req("b")])))
        record(2, runner.execute_batch(DiffusionSchedulerOutput(new_requests=[req("bad")])))
        record(3, runner.execute_batch(DiffusionSchedulerOutput(new_requests=[req("c")])))
    else:
        reqs = [req("a"), req("bad"), req("b")]
        ids = [r.request_id for r in reqs]
        record(1, runner.execute_step(DiffusionSchedulerOutput(new_requests=reqs, scheduled_ids=ids)))
        live = [i for i in ids if not i.endswith("-bad")]
        record(2, runner.execute_step(DiffusionSchedulerOutput(scheduled_ids=live, finished_ids=[ids[1]])))
        c = req("c")
        record(3, runner.execute_step(DiffusionSchedulerOutput(new_requests=[c], scheduled_ids=[c.request_id])))
        record(4, runner.execute_step(DiffusionSchedulerOutput(scheduled_ids=[c.request_id])))
    rows.append(("seconds", time.monotonic() - t0))
    return rows


@pytest.mark.parametrize("path", ["request", "step"])
def test_one_rank_raising_fails_the_wave_on_both_and_both_serve_the_next(path):
    results = spawn_workers(f"{__file__}:_worker", 2, (path,), timeout=TIMEOUT_S)
    for rank, rows in enumerate(results):
        seconds = rows.pop()[1]
        assert seconds < 30, f"rank {rank} took {seconds:.0f} s: something waited for a timeout"
        waves = {wave: (outs, held) for wave, outs, held in rows}
        # the peer names the failing rank and its cause (an out-of-memory error travels with the agreement)
        other = "CUDA out of memory" if rank == 1 else "rank 1 of this replica ran out of memory in the same call"
        if path == "request":
            assert {k: v[0] for k, v in waves[1][0].items()} == {"a": "completed", "bad": "error", "b": "completed"}
            assert other in waves[1][0]["bad"][2], (rank, waves[1][0]["bad"])
            assert waves[2][0]["bad"][0] == "error" and other in waves[2][0]["bad"][2]
            assert waves[3][0] == {"c": ("completed", True, "")}
        else:
            assert waves[1][0]["bad"][0] == "error" and other in waves[1][0]["bad"][2], (rank, waves[1])
            assert [waves[1][0][k][:2] for k in ("a", "b")] == [("completed", False)] * 2, (rank, waves[1])
            assert waves[1][1] == ["step-a", "step-b"], (rank, waves[1])  # nobody holds 'bad' any more
            assert waves[2][0] == {"a": ("completed", True, ""), "b": ("completed", True, "")}, (rank, waves[2])
            assert waves[4][0] == {"c": ("completed", True, "")} and waves[4][1] == [], (rank, waves[4])
    assert [r[:1] for r in results[0]] == [r[:1] for r in results[1]]


#: process-group timeout of the abort test: a peer left blocked in a collective fails only after this long, so
#: every wave of that test must end far inside it (a rebuild takes well under a second on gloo)
ABORT_TIMEOUT_S = 60


def _abort_worker(rank: int, world_size: int, path: str) -> dict:
    """cfg-2: each step's guided prediction gathers the two branches (rank 0 the positive, rank 1 the negative);
    rank 1 raises in its branch for ``bad``, before the all-gather rank 0 is already blocked in."""
    import time

    import torch

    from omni_core.config import OmniDiffusionConfig, ParallelConfig, SamplingParams
    from omni_core.distributed import cfg_parallel_guidance, init_parallel_state
    from omni_core.distributed.recovery import GroupRecovery
    from omni_core.outputs import DiffusionOutput
    from omni_core.pipelines.base import OmniPipeline
    from omni_core.request import OmniDiffusionRequest
    from omni_core.waves import DiffusionSchedulerOutput
    from omni_core.worker.runner import ModelRunner

    init_parallel_state(ParallelConfig(cfg_parallel_size=2))
    recovery = GroupRecovery(ABORT_TIMEOUT_S)

    import torch.distributed as dist

    def like_torchao(group=dist.group.WORLD):  # holds the group in its defaults, as torchao 0.18's functions do
        return group

    class Stub(OmniPipeline):
        def __init__(self) -> None:
            pass

        def prepare_encode(self, state):
            state.num_steps = 2
            state.latents = torch.zeros(4)
            return state

        def denoise_step(self, states):
            x = torch.stack([s.latents for s in states])

            def negative():
                if rank == 1 and any(s.request.prompt == "bad" for s in states):
                    raise torch.OutOfMemoryError("CUDA out of memory (test: rank 1 only, before the all-gather)")
                return x - 1.0

            return list(cfg_parallel_guidance(lambda: x + 1.0, negative, 3.0))  # x - 1 + 3 * 2 = x + 5

        def step_scheduler(self, state, pred):
            state.latents = pred
            state.step_index += 1

        def post_decode(self, state):
            return DiffusionOutput(request_id=state.request_id, tensor=state.latents.clone())

    runner = ModelRunner(OmniDiffusionConfig(model="shapes"), None, device=torch.device("cpu"),
                         dtype=torch.float32, rank=rank, world_size=world_size, stop_group=(None, 0, world_size),
                         recovery=recovery)
    runner.pipeline = Stub()
    waves: dict = {}

    def req(name):
        return OmniDiffusionRequest(prompt=name, request_id=f"{path}-{name}",
                                    sampling_params=SamplingParams(seed=0, num_inference_steps=2))

    def run(wave, call, sched):
        t0 = time.monotonic()
        result = call(sched)
        waves[wave] = ({rid.split("-", 1)[1]: (o.status, o.finished, o.error or "",
                                               None if o.tensor is None else o.tensor.tolist())
                        for rid, o in result.outputs.items()}, sorted(runner.held_ids()), time.monotonic() - t0)

    t0 = time.monotonic()
    if path == "request":
        run(1, runner.execute_batch, DiffusionSchedulerOutput(new_requests=[req("a"), req("bad"), req("b")]))
        run(2, runner.execute_batch, DiffusionSchedulerOutput(new_requests=[req("bad")]))
        run(3, runner.execute_batch, DiffusionSchedulerOutput(new_requests=[req("c")]))
    else:
        reqs = [req("a"), req("bad"), req("b")]
        ids = [r.request_id for r in reqs]
        run(1, runner.execute_step, DiffusionSchedulerOutput(new_requests=reqs, scheduled_ids=ids))
        live = [i for i in ids if not i.endswith("-bad")]
        run(2, runner.execute_step, DiffusionSchedulerOutput(scheduled_ids=live, finished_ids=[ids[1]]))
        c = req("c")
        run(3, runner.execute_step, DiffusionSchedulerOutput(new_requests=[c], scheduled_ids=[c.request_id]))
        run(4, runner.execute_step, DiffusionSchedulerOutput(scheduled_ids=[c.request_id]))
    recovery.close()
    assert like_torchao() is None  # the aborted group was scrubbed from the defaults (None: the default group)
    return {"waves": waves, "seconds": time.monotonic() - t0, "rebuilds": recovery.rebuilds,
            "generation": recovery.generation}


@pytest.mark.parametrize("path", ["request", "step"])
def test_rank_raising_before_a_collective_its_peer_waits_in_aborts_and_rebuilds_the_groups(path):
    """Rank 1 raises before the cfg all-gather rank 0 is blocked in: rank 1 aborts the process groups, so rank 0's
    all-gather fails at once instead of after the process-group timeout; both rebuild the groups, fail the
    wave's request together and serve the next with the right output. Without the abort, rank 0 waits
    ``ABORT_TIMEOUT_S`` and the run times out."""
    results = spawn_workers(f"{__file__}:_abort_worker", 2, (path,), timeout=ABORT_TIMEOUT_S)
    guided = [10.0] * 4  # two steps of x + 5 from zeros: both branches, gathered across the ranks
    for rank, res in enumerate(results):
        waves = res["waves"]
        slowest = max(seconds for _, _, seconds in waves.values())
        # far below the timeout: a rebuild on gloo takes ~0.1 s; the bound leaves room for a loaded CI machine
        assert slowest < ABORT_TIMEOUT_S / 6, f"rank {rank}: a wave took {slowest:.1f} s (timeout {ABORT_TIMEOUT_S} s)"
        assert res["rebuilds"] >= 1 and res["rebuilds"] == res["generation"], (rank, res)
        # the peer names the failing rank and its cause (an out-of-memory error travels with the agreement)
        other = "CUDA out of memory" if rank == 1 else "rank 1 of this replica ran out of memory in the same call"
        outs = {wave: w[0] for wave, w in waves.items()}
        if path == "request":
            assert {k: v[0] for k, v in outs[1].items()} == {"a": "completed", "bad": "error", "b": "completed"}
            assert other in outs[1]["bad"][2], (rank, outs[1]["bad"])
            assert outs[1]["a"][3] == outs[1]["b"][3] == guided, (rank, outs[1])
            assert outs[2]["bad"][0] == "error" and other in outs[2]["bad"][2], (rank, outs[2])
            assert outs[3] == {"c": ("completed", True, "", guided)}, (rank, outs[3])
        else:
            assert outs[1]["bad"][0] == "error" and other in outs[1]["bad"][2], (rank, outs[1])
            assert [outs[1][k][:2] for k in ("a", "b")] == [("completed", False)] * 2, (rank, outs[1])
            assert waves[1][1] == ["step-a", "step-b"], (rank, waves[1])  # nobody holds 'bad' any more
            assert outs[2] == {"a": ("completed", True, "", guided), "b": ("completed", True, "", guided)}, rank
            assert outs[4] == {"c": ("completed", True, "", guided)} and waves[4][1] == [], (rank, waves[4])
    assert results[0]["rebuilds"] == results[1]["rebuilds"]

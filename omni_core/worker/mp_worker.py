"""Entry point of a worker process of the ``mp`` executor.

Each rank initialises its device and ``torch.distributed``, loads the pipeline, then runs a busy loop:
it takes every wave from its own task queue (the executor sends each wave to every rank once) and rank 0
returns the result. Aborts reach rank 0 through a separate queue and are agreed with the other ranks by a
broadcast at each step boundary.
"""

from __future__ import annotations

import os
import queue
import sys
import traceback
from typing import Any

from omni_core.worker.transport import pack_outputs


def _drain(q: Any) -> list[str]:
    """Every id waiting on the abort queue, without blocking (the runner serialises concurrent callers)."""
    ids: list[str] = []
    while True:
        try:
            ids.extend(q.get_nowait())
        except queue.Empty:
            return ids


#: tracebacks sent to the engine are cut to this many characters: a put blocks until the engine reads it,
#: and a message must fit the pipe when nobody is reading (a start-up failure)
MAX_TRACEBACK_CHARS = 16000


def _traceback() -> str:
    text = traceback.format_exc()
    return text if len(text) <= MAX_TRACEBACK_CHARS else "...\n" + text[-MAX_TRACEBACK_CHARS:]


def _replica_group(config: Any, rank: int, world_size: int) -> tuple[int, list[int], Any]:
    """(replica index, the replica's ranks (leader first), its process group (None = the world)).

    Data-parallel replicas run different requests, so per-step agreements (abort flags) happen inside a
    replica. Every rank creates every replica's group, in order, as ``new_group`` requires.
    """
    import torch.distributed as dist

    from omni_core.distributed.parallel_state import RankLayout

    replicas = RankLayout.from_config(config.parallel_config).replicas()
    index = next(i for i, ranks in enumerate(replicas) if rank in ranks)
    if len(replicas) == 1:
        return 0, replicas[0], None
    groups = [dist.new_group(ranks) if len(ranks) > 1 else None for ranks in replicas]
    return index, replicas[index], groups[index]


def worker_main(rank: int, world_size: int, config: Any, resolved: Any, master_port: int, task_q: Any,
                result_q: Any, abort_q: Any, parent_pid: int | None = None) -> None:
    if parent_pid is not None:  # first of all: a worker must never outlive the engine's process
        from omni_core.worker.parent_watch import die_with_parent

        die_with_parent(parent_pid)
    try:
        os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port)})
        import datetime

        import torch
        import torch.distributed as dist

        from omni_core.platforms import platform_for
        from omni_core.waves import RunnerOutput
        from omni_core.worker.runner import ModelRunner, torch_dtype

        platform = platform_for(config)  # the config's platform, not only what detection finds here
        from omni_core.platforms.threads import apply_thread_policy

        apply_thread_policy(config, processes=world_size)
        device = platform.get_torch_device(rank)
        platform.set_device(device)
        backend = "gloo" if device.type == "cpu" else platform.dist_backend
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{master_port}", rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=120))
        _init_parallel_state(config, rank, world_size)
        replica, replica_ranks, replica_group = _replica_group(config, rank, world_size)
        is_leader = rank == replica_ranks[0]
        progress = (lambda events: result_q.put(("progress", events))) if is_leader else None
        runner = ModelRunner(config, resolved, device=device, dtype=torch_dtype(config, platform), rank=rank,
                             world_size=world_size, on_progress=progress,
                             poll_aborts=(lambda: _drain(abort_q)) if is_leader else None,
                             stop_group=(replica_group, replica_ranks[0], len(replica_ranks)))
        runner.load_model()
        result_q.put(("ready", rank, runner.model_bytes))
    except BaseException:  # noqa: BLE001 - report any start-up failure to the engine
        result_q.put(("fatal", rank, _traceback()))
        return

    while True:
        msg = task_q.get()
        kind = msg[0]
        if kind == "shutdown":
            break
        try:
            if kind == "batch":
                out = runner.execute_batch(msg[1])
            elif kind == "step":
                out = runner.execute_step(msg[1])
            elif kind == "release":
                runner.release(msg[1])
                out = RunnerOutput(held_ids=runner.held_ids())
            else:
                raise ValueError(f"unknown message kind {kind!r}")
        except BaseException:  # noqa: BLE001
            if is_leader:
                result_q.put(("error", replica, _traceback()))
            continue
        if is_leader:
            result_q.put(("result", replica, pack_outputs(out)))
    try:
        _destroy_parallel_state()
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass
    # Skip the interpreter's teardown: with torch and diffusers loaded it takes seconds per worker (measured
    # 2-5 s on 2 cores); multiprocessing's own exit work (queue feeders, semaphores such as tqdm's lock) still runs.
    from multiprocessing import util

    util._exit_function()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _init_parallel_state(config: Any, rank: int, world_size: int) -> None:
    try:
        from omni_core.distributed import init_parallel_state
    except ImportError:
        return
    init_parallel_state(config.parallel_config, rank, world_size)


def _destroy_parallel_state() -> None:
    try:
        from omni_core.distributed import destroy_parallel_state
    except ImportError:
        return
    destroy_parallel_state()

"""Entry point of a worker process of the ``mp`` executor.

Each rank initialises its device and ``torch.distributed``, loads the pipeline, then runs a busy loop:
it takes every wave from its own task queue (the executor sends each wave to every rank once) and rank 0
returns the result. Aborts reach rank 0 through a separate queue and are agreed with the other ranks by a
broadcast at each step boundary.
"""

from __future__ import annotations

import collections
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


#: a worker sends the request path's progress events at most this often (and at the end of every wave), as
#: tqdm refreshes a bar: a message per step cost ~0.3 ms of the engine's time per step on 2 cores
PROGRESS_INTERVAL_S = 0.1

#: tracebacks sent to the engine are cut to this many characters: a put blocks until the engine reads it,
#: and a message must fit the pipe when nobody is reading (a start-up failure)
MAX_TRACEBACK_CHARS = 16000


def _traceback() -> str:
    text = traceback.format_exc()
    return text if len(text) <= MAX_TRACEBACK_CHARS else "...\n" + text[-MAX_TRACEBACK_CHARS:]


class BackgroundSender:
    """A worker's messages to the engine, written in order by a thread of its own, so the worker starts its
    next wave while the last result is pickled and written (a step wave's result is ~0.1-0.3 ms of that on 2
    cores, time the model would otherwise wait; ``bench/hot_path.py``). ``put`` never blocks; ``close``
    returns once everything put before it is written. If writing fails (the engine is gone), the rest is
    dropped: the worker dies with its parent anyway (``parent_watch``)."""

    def __init__(self, result_q: Any) -> None:
        import threading

        self._out = result_q
        self._pending: queue.SimpleQueue = queue.SimpleQueue()
        #: messages put and not yet written (``unsent``); only ``put`` adds and only the writer takes away
        self._unsent = 0
        self._count_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="omni-result-sender", daemon=True)
        self._thread.start()

    def put(self, msg: Any) -> None:
        with self._count_lock:
            self._unsent += 1
        self._pending.put(msg)

    @property
    def unsent(self) -> int:
        """Messages put and not yet written to the other process."""
        return self._unsent

    def _run(self) -> None:
        while (msg := self._pending.get()) is not None:
            try:
                self._out.put(msg)
            except Exception:  # noqa: BLE001 - the engine's end of the pipe is gone
                traceback.print_exc()
                return
            with self._count_lock:
                self._unsent -= 1

    def close(self, timeout: float = 60.0) -> None:
        self._pending.put(None)
        self._thread.join(timeout)


class BackgroundReceiver:
    """A worker's messages from the engine, read and unpickled by a thread of its own while the model runs,
    so the next wave is a local queue's item when the last one ends. Read at the step boundary instead, a
    ~300-byte step wave cost 0.4 ms there on 2 cores (measured in the worker's loop, ``shapes``, step mode,
    queue depth 64: the read, poll and unpickle each give up the GIL and the core to the sender thread and
    the engine's process, which wake at that same moment); taken from here, microseconds. It also lets the
    leader see a replacement wave (``_replaced``) without a system call. Stops after ``("shutdown",)``; if
    reading fails (the engine is gone), it hands the loop a shutdown."""

    def __init__(self, task_q: Any) -> None:
        import threading

        self._in = task_q
        self._ready: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="omni-wave-receiver", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                msg = self._in.get()
            except Exception:  # noqa: BLE001 - the engine's end of the pipe is gone
                traceback.print_exc()
                msg = ("shutdown",)
            self._ready.put(msg)
            if msg[0] == "shutdown":
                return

    def get(self) -> Any:
        """The next message, waiting for it."""
        return self._ready.get()

    def take_ready(self, into: collections.deque) -> None:
        """Move every message already received into ``into``, without waiting."""
        while True:
            try:
                into.append(self._ready.get_nowait())
            except queue.Empty:
                return


#: set to a path prefix, every worker profiles its wave loop (cProfile) and writes ``<prefix>.rank<N>`` at
#: shutdown: where a worker's time outside the model goes (``bench/hot_path.py --profile``)
PROFILE_ENV = "OMNI_WORKER_PROFILE"


def _start_profile() -> Any:
    if not os.environ.get(PROFILE_ENV):
        return None
    import cProfile

    profile = cProfile.Profile()
    profile.enable()
    return profile


def _replaced(inbox: BackgroundReceiver, queued: collections.deque) -> bool:
    """Whether the step wave about to run is replaced by the next one, already queued behind it
    (``DiffusionSchedulerOutput.replaces_queued``). Takes what ``inbox`` holds now into ``queued`` (the
    leader's view decides for the whole replica: ``ModelRunner.agree``)."""
    inbox.take_ready(queued)
    nxt = queued[0] if queued else None
    return nxt is not None and nxt[0] == "step" and getattr(nxt[1], "replaces_queued", False)


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
                result_q: Any, abort_q: Any, parent_pid: int | None = None,
                environment: dict[str, str] | None = None) -> None:
    from omni_core.processes import child_setup

    child_setup(parent_pid, environment, f"omni-worker-{rank}")  # first of all: never outlive the engine
    if not run_worker(rank, world_size, config, resolved, master_port, task_q, result_q, abort_q):
        return
    # Skip the interpreter's teardown: with torch and diffusers loaded it takes seconds per worker (measured
    # 2-5 s on 2 cores); multiprocessing's own exit work (queue feeders, semaphores such as tqdm's lock) still runs.
    from multiprocessing import util

    util._exit_function()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_worker(rank: int, world_size: int, config: Any, resolved: Any, master_port: int, task_q: Any,
               result_q: Any, abort_q: Any, *, master_addr: str = "127.0.0.1", local_rank: int | None = None,
               local_world_size: int | None = None, pack: Any = pack_outputs, seal: Any = None) -> bool:
    """One rank's whole life: start-up, the wave loop, teardown; returns False if start-up failed (reported
    as ``("fatal", rank, traceback)``). Transport-agnostic so every executor runs this same loop: ``task_q``
    needs a blocking ``get()`` (read by a :class:`BackgroundReceiver`), ``result_q`` ``put()``, ``abort_q``
    ``get_nowait()`` raising ``queue.Empty`` (the ``mp`` worker passes its process queues; a Ray actor passes local ``queue.Queue``
    objects it feeds).
    ``master_addr`` is the rendezvous host (rank 0's node), ``local_rank`` the device index on this host and
    ``local_world_size`` the model processes sharing this host's cores (both default to the one-host values);
    ``pack`` prepares a result for the trip to the engine (:func:`~omni_core.worker.transport.pack_outputs`);
    ``seal``: how what this rank hands a stage process is sealed (a ``SealMode``; None: shared memory)."""
    local_rank = rank if local_rank is None else local_rank
    result_q = BackgroundSender(result_q)
    try:
        os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(local_rank),
                           "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)})
        import datetime

        import torch.distributed as dist

        from omni_core.platforms import platform_for
        from omni_core.waves import RunnerOutput
        from omni_core.utils.dtypes import torch_dtype
        from omni_core.worker.runner import ModelRunner

        platform = platform_for(config)  # the config's platform, not only what detection finds here
        from omni_core.platforms.threads import apply_thread_policy

        apply_thread_policy(config, processes=local_world_size or world_size)
        device = platform.get_torch_device(local_rank)
        platform.set_device(device)
        backend = "gloo" if device.type == "cpu" else platform.dist_backend
        timeout = datetime.timedelta(seconds=PROCESS_GROUP_TIMEOUT_S)
        dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank,
                                world_size=world_size, timeout=timeout)
        _init_parallel_state(config, rank, world_size)
        replica, replica_ranks, replica_group = _replica_group(config, rank, world_size)
        recovery = _group_recovery(replica_ranks, world_size, timeout)
        is_leader = rank == replica_ranks[0]
        progress = (lambda events: result_q.put(("progress", events))) if is_leader else None
        runner = ModelRunner(config, resolved, device=device, dtype=torch_dtype(config, platform), rank=rank,
                             world_size=world_size, on_progress=progress,
                             poll_aborts=(lambda: _drain(abort_q)) if is_leader else None,
                             stop_group=(replica_group, replica_ranks[0], len(replica_ranks)),
                             progress_interval_s=PROGRESS_INTERVAL_S, recovery=recovery, seal=seal)
        runner.load_model()
        result_q.put(("ready", rank, runner.model_bytes))
    except BaseException:  # noqa: BLE001 - report any start-up failure to the engine
        result_q.put(("fatal", rank, _traceback()))
        result_q.close()
        return False

    inbox = BackgroundReceiver(task_q)
    queued: collections.deque = collections.deque()  # messages taken early, to look behind a step wave
    profile = _start_profile()
    while True:
        msg = queued.popleft() if queued else inbox.get()
        kind = msg[0]
        if kind == "shutdown":
            break
        try:
            if kind == "batch":
                out = runner.execute_batch(msg[1])
            elif kind == "step":
                sched = msg[1]
                if sched.may_be_replaced and runner.agree([is_leader and _replaced(inbox, queued)])[0]:
                    if not queued:  # a rank other than the leader: the replacement is on its way
                        queued.append(inbox.get())
                    out = runner.skip_step(sched, queued[0][1])
                else:
                    out = runner.execute_step(sched)
            elif kind == "release":
                runner.release(msg[1])
                out = RunnerOutput(held_ids=runner.held_ids())
            elif kind == "call":  # every rank answers (omni_core.executor.collective)
                try:
                    method, args, kwargs = msg[1]
                    value = getattr(runner, method)(*args, **kwargs)
                except BaseException:  # noqa: BLE001 - the caller learns which rank failed and why
                    result_q.put(("called", rank, False, _traceback()))
                else:
                    result_q.put(("called", rank, True, value))
                continue
            else:
                raise ValueError(f"unknown message kind {kind!r}")
        except BaseException:  # noqa: BLE001
            if is_leader:
                result_q.put(("error", replica, _traceback()))
            continue
        if is_leader:
            result_q.put(("result", replica, pack(out)))  # small tensors copied here: the sender owns them
    result_q.close()  # every result is written before the process group goes
    if profile is not None:
        profile.disable()
        profile.dump_stats(f"{os.environ[PROFILE_ENV]}.rank{rank}")
    try:
        if recovery is not None:
            recovery.close()
        _destroy_parallel_state()
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass
    return True


#: ``torch.distributed`` timeout of a worker's process groups: how long a collective (or a rebuild's rendezvous)
#: waits for a peer that never comes
PROCESS_GROUP_TIMEOUT_S = 120


def _group_recovery(replica_ranks: list[int], world_size: int, timeout: Any) -> Any:
    """A :class:`~omni_core.distributed.recovery.GroupRecovery` where this rank's replica is the whole world
    of several ranks (the one case a replica can rebuild the default group by itself), else None."""
    if world_size <= 1 or len(replica_ranks) != world_size:
        return None
    from omni_core.distributed.recovery import GroupRecovery

    return GroupRecovery(timeout)


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

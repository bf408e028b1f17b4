"""One process abstraction (``omni_core.executor.process_group``): the ``mp`` executor, the stage processes and
the Ray plugin's actors are each a ``ProcessGroup``, and the Ray plugin reuses ``mp`` through it alone."""

from __future__ import annotations

import ast
import functools
import os
import queue
import signal
import threading
import time
from pathlib import Path

import pytest

from omni_core.errors import EngineDeadError
from omni_core.executor.process_group import LocalProcessGroup
from omni_core.testing.processes import alive, echo_rank

REPO = Path(__file__).resolve().parents[2]


def _group(size: int = 2, **kwargs) -> LocalProcessGroup:
    parent = os.getpid()
    fail = kwargs.pop("fail", None)

    def args_for(rank, task_q, result_q, abort_q):
        return (rank, task_q, result_q, abort_q, parent, rank == fail)

    return LocalProcessGroup("echo", echo_rank, args_for, [f"omni-echo-{r}" for r in range(size)], **kwargs)


def _answers(group: LocalProcessGroup, n: int) -> list[tuple]:
    got = []
    deadline = time.monotonic() + 30
    while len(got) < n and time.monotonic() < deadline:
        try:
            got.append(group.receive(0.2))
        except queue.Empty:
            pass
    return got


def test_spawn_ready_send_receive_abort_and_stop():
    group = _group()
    group.spawn()
    try:
        ready = group.wait_ready(60)
        assert [r["pid"] for r in ready] == group.pids() and os.getpid() not in group.pids()
        group.send_abort(1, ["r7"])
        time.sleep(0.3)  # the abort channel is a Queue: its feeder thread writes it
        for rank in (0, 1):
            group.send(rank, ("echo", f"hello {rank}"))
        answers = sorted(_answers(group, 2))
        assert answers == [("echoed", 0, "hello 0", []), ("echoed", 1, "hello 1", ["r7"])]
        pids = group.pids()
    finally:
        group.stop()
    assert not any(alive(p) for p in pids) and group.dead is None  # a stop is no death


def test_a_death_is_reported_once_with_the_process_and_its_exit_code():
    deaths: list[str] = []
    group = _group()
    group.on_death = deaths.append
    group.spawn()
    try:
        group.wait_ready(60)
        victim = group.pids()[1]
        # what torch leaves when a kill lands between creating a tensor's segment and unlinking it
        left = Path("/dev/shm") / f"torch_{victim}_0_1"
        left.write_bytes(b"\0" * 64)
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not deaths and time.monotonic() < deadline:
            time.sleep(0.05)
        assert deaths == [f"omni-echo-1 (pid {victim}) exited with code -9"] and group.dead == deaths[0]
        assert not left.exists(), "the dead process's segment was left in /dev/shm"
        assert group.wait_death(0) == deaths[0]
    finally:
        group.stop()
    assert deaths == [group.dead]


def test_a_failed_start_names_the_rank_and_leaves_nothing():
    group = _group(fail=1)
    group.spawn()
    try:
        with pytest.raises(EngineDeadError, match="omni-echo-1 failed to start:\necho_rank was asked to fail"):
            group.wait_ready(60)
    finally:
        group.stop()
    assert not any(alive(p) for p in group.pids())


def test_a_watching_group_hands_messages_to_its_callback():
    seen: list[tuple] = []
    got = threading.Event()
    group = _group(size=1, on_message=lambda m: (seen.append(m), got.set()), background_send=True)
    group.spawn()
    try:
        group.wait_ready(60)
        group.send(0, ("echo", "x"))
        assert got.wait(30) and seen == [("echoed", 0, "x", [])]
    finally:
        group.stop()


def _private_methods(path: Path, cls: str) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    (node,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls]
    return {n.name for n in node.body if isinstance(n, ast.FunctionDef) and n.name.startswith("_")
            and not n.name.startswith("__")}


def test_the_ray_plugin_overrides_no_private_method_of_the_mp_executor():
    private = _private_methods(REPO / "omni_core" / "executor" / "mp.py", "MultiProcExecutor")
    assert private  # the check reads the class it means to
    ray_src = REPO / "plugins" / "executors" / "ray" / "src" / "omni_executor_ray"
    defined = {f"{p.name}:{n.name}" for p in sorted(ray_src.glob("*.py"))
               for n in ast.walk(ast.parse(p.read_text(encoding="utf-8")))
               if isinstance(n, ast.FunctionDef) and n.name in private}
    assert not defined, f"the Ray plugin re-implements mp's private methods (use a ProcessGroup): {sorted(defined)}"


def test_every_process_system_is_a_process_group():
    """The mp executor, the stages and the Ray plugin build their processes through ``ProcessGroup`` only: none
    starts a ``multiprocessing`` process or a process-watching thread of its own."""
    files = [REPO / "omni_core" / "executor" / "mp.py", REPO / "omni_core" / "executor" / "stage_process.py",
             REPO / "plugins" / "executors" / "ray" / "src" / "omni_executor_ray" / "executor.py"]
    for path in files:
        text = path.read_text(encoding="utf-8")
        assert "ProcessGroup" in text, path
        assert ".Process(" not in text and "threading.Thread(" not in text, f"{path.name} starts its own"

"""Workers die with their parent: SIGKILL the process that owns an ``mp`` executor (a script using ``Omni``,
or ``omni serve --executor mp``) and every worker is gone within a bounded time. The two mechanisms of
``omni_core.processes.parent_watch`` are also tested alone, each in a real orphaned process."""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from omni_core.testing.processes import alive, descendants

pytestmark = pytest.mark.dist

#: a killed parent's workers must be gone within this (the parent watch polls every second)
GONE_WITHIN_S = 20.0

OWNER = textwrap.dedent("""
    import sys, threading, time
    from omni_core import Omni

    if __name__ == "__main__":
        model, where = sys.argv[1], sys.argv[2]
        box = {}
        make = lambda: box.setdefault("omni", Omni(model, executor="mp", parallel_config={"cfg_parallel_size": 2},
                                                   warmup=False))
        if where == "thread":  # built in a thread that ends at once: the workers must not die with it
            t = threading.Thread(target=make)
            t.start()
            t.join()
            time.sleep(1.5)
        else:
            make()
        omni = box["omni"]
        assert omni.generate("still alive", use_tqdm=False)[0].status == "completed"
        print("PIDS", *omni.engine.executor.worker_pids(), flush=True)
        time.sleep(600)
""")


def read_line(proc: subprocess.Popen, pattern: str, timeout: float = 180.0) -> re.Match:
    """The first stdout line of ``proc`` matching ``pattern``; fails the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    seen = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or proc.poll() is not None:
            pytest.fail(f"no line matching {pattern!r} within {timeout} s (exit {proc.poll()}): {''.join(seen)}")
        ready, _, _ = select.select([proc.stdout], [], [], min(left, 0.5))
        if ready:
            line = proc.stdout.readline()
            seen.append(line)
            m = re.search(pattern, line)
            if m:
                return m


def kill_parent_and_wait_for(proc: subprocess.Popen, pids: list[int]) -> None:
    assert pids and all(alive(p) for p in pids)
    try:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        deadline = time.monotonic() + GONE_WITHIN_S
        while any(alive(p) for p in pids):
            if time.monotonic() > deadline:
                pytest.fail(f"workers {[p for p in pids if alive(p)]} still run {GONE_WITHIN_S} s after their "
                            f"parent {proc.pid} was SIGKILLed")
            time.sleep(0.1)
    finally:
        for p in pids:  # never leave a failed test's workers behind
            if alive(p):
                os.kill(p, signal.SIGKILL)


def env_without_omni_switches() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("OMNI_")}


@pytest.mark.parametrize("where", ["main", "thread"])
def test_workers_of_a_killed_omni_script_die(tiny_model, tmp_path, where):
    script = tmp_path / "owner.py"
    script.write_text(OWNER)
    proc = subprocess.Popen([sys.executable, str(script), tiny_model, where], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env_without_omni_switches())
    try:
        pids = [int(p) for p in read_line(proc, r"^PIDS ([\d ]+)$").group(1).split()]
        assert len(pids) == 2 and set(pids) <= set(descendants(proc.pid))
        kill_parent_and_wait_for(proc, descendants(proc.pid))  # the workers and every helper process
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_workers_of_a_killed_omni_serve_die(tiny_model):
    omni = Path(sys.executable).parent / "omni"
    proc = subprocess.Popen([str(omni), "serve", tiny_model, "--port", "0", "--executor", "mp", "--log-level",
                             "warning"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=env_without_omni_switches())
    try:
        read_line(proc, r"on (http://\S+) ")
        below = descendants(proc.pid)  # the worker, and what started it (the fork server, the resource tracker)
        assert len(below) >= 2, below
        kill_parent_and_wait_for(proc, below)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


ORPHAN = textwrap.dedent("""
    import multiprocessing, os, subprocess, sys, time

    def forked_child(armed):  # a fork-server child: its parent PID is the server's, its creator is the script
        from omni_core.processes import parent_watch
        creator = multiprocessing.parent_process()
        parent_watch.watch_creator(creator.sentinel, creator.pid)
        open(armed, "w").close()
        time.sleep(600)

    if __name__ != "__main__":
        pass
    elif sys.argv[1] == "parent" and sys.argv[2] == "creator-sentinel":
        child = multiprocessing.get_context("forkserver").Process(target=forked_child, args=(sys.argv[3],))
        child.start()
        print("CHILD", child.pid, flush=True)
        time.sleep(600)
    elif sys.argv[1] == "parent":  # start the child, then wait to be killed
        child = subprocess.Popen([sys.executable, __file__, "child", sys.argv[2], sys.argv[3]])
        print("CHILD", child.pid, flush=True)
        time.sleep(600)
    else:
        from omni_core.processes import parent_watch
        mode, armed = sys.argv[2], sys.argv[3]
        if mode == "death-signal":
            assert parent_watch.set_death_signal()
        else:
            parent_watch.watch_parent(os.getppid(), interval=0.2)
        open(armed, "w").close()
        time.sleep(600)
""")


@pytest.mark.parametrize("mode", [
    pytest.param("death-signal", marks=pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux")),
    "parent-watch", "creator-sentinel"])
def test_each_mechanism_alone_ends_an_orphan(tmp_path, mode):
    script, armed = tmp_path / "orphan.py", tmp_path / "armed"
    script.write_text(ORPHAN)
    proc = subprocess.Popen([sys.executable, str(script), "parent", mode, str(armed)], stdout=subprocess.PIPE,
                            text=True, env=env_without_omni_switches())
    try:
        child = int(read_line(proc, r"^CHILD (\d+)$", timeout=60).group(1))
        deadline = time.monotonic() + 60
        while not armed.exists():
            assert time.monotonic() < deadline, "the child did not arm its mechanism within 60 s"
            time.sleep(0.05)
        kill_parent_and_wait_for(proc, [child])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

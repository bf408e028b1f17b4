"""The engine has one owner: the core's loop (``omni_core.engine.core``).

Read from the source (AST): no module reaches into another object's private members inside the engine package,
and none outside it reads or writes the core's. At run time: the engine starts no thread but its loop (the
executor's own: its call thread and, for ``mp``, one watcher), and callers are answered while a wave runs.
"""

from __future__ import annotations

import ast
import threading
import time
from pathlib import Path

import pytest

from omni_core.config import OmniDiffusionConfig
from omni_core.engine import DiffusionEngine
from omni_core.request import OmniDiffusionRequest

REPO = Path(__file__).resolve().parents[2]
ENGINE = REPO / "omni_core" / "engine"
CORE = ENGINE / "core.py"


def private_reaches(path: Path, names: set[str] | None = None) -> list[str]:
    """``file:line: expr._name`` for every attribute access ``x._name`` where ``x`` is not ``self``/``cls``
    (restricted to ``names`` when given)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
                and (names is None or node.attr in names)):
            found.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)}")
    return found


def core_private_members() -> set[str]:
    """The private attributes and methods ``EngineCore`` defines."""
    tree = ast.parse(CORE.read_text(encoding="utf-8"))
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "EngineCore"]
    names = {n.name for n in cls.body if isinstance(n, ast.FunctionDef) and n.name.startswith("_")
             and not n.name.startswith("__")}
    names |= {n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
              and n.value.id == "self" and n.attr.startswith("_") and not n.attr.startswith("__")}
    return names


def test_no_engine_module_reaches_into_another_objects_private_members():
    found = [hit for path in sorted(ENGINE.glob("*.py")) for hit in private_reaches(path)]
    assert not found, f"the engine's modules use each other through public members only: {found}"


def test_no_module_outside_the_core_touches_its_private_members():
    names = core_private_members()
    assert {"_records", "_inbox", "_run"} <= names
    files = [p for p in sorted((REPO / "omni_core").rglob("*.py")) if p != CORE]
    # the front's own handle on the core is ``self._core``; anything reaching *through* it is a reach
    found = [hit for path in files for hit in private_reaches(path, names)]
    found += [f"{p.relative_to(REPO)}: ._core.<private>" for p in files
              if "_core._" in p.read_text(encoding="utf-8")]
    assert not found, f"only the core reads or writes its state: {found}"


def _threads() -> set[threading.Thread]:
    """The live threads as objects: an ident can be reused by a new thread once an old one ended (a thread of an
    earlier test ending as this engine starts), a Thread object cannot."""
    return set(threading.enumerate())


@pytest.mark.parametrize("executor, own", [("uni", {"omni-engine", "omni-executor-calls"}),
                                           ("mp", {"omni-engine", "omni-executor-calls", "omni-worker-monitor"})])
def test_the_engine_starts_no_thread_but_its_loop(tiny_model, executor, own):
    """Deadlines, aborts, stage results and output delivery need no thread of their own: besides the loop,
    only the executor's threads (its call thread and one watcher of its processes) run."""
    before = _threads()
    config = OmniDiffusionConfig.from_kwargs(model=tiny_model, executor=executor, warmup=False, step_execution=True)
    engine = DiffusionEngine(config)
    try:
        timed = OmniDiffusionRequest(prompt="x", sampling_params=config_params(steps=200, timeout=0.1))
        plain = [OmniDiffusionRequest(prompt="y", sampling_params=config_params(steps=3)) for _ in range(2)]
        handles = engine.submit([timed, *plain])
        engine.abort(plain[1].request_id)
        outs = [h.result(timeout=60) for h in handles]
        assert [o.status for o in outs] == ["error", "completed", "aborted"] and "timed out" in outs[0].error
        new = {t.name for t in _threads() - before}
        # a multiprocessing Queue's feeder thread (the mp executor's abort queue) is the queue's, started by a put
        # the model's own lanes (``worker/lanes.py``) run where the model does: in this process with ``uni``
        new = {n for n in new if not n.startswith(("QueueFeederThread", "omni-lane"))}
        assert new == own, f"threads the engine started: {sorted(new)}"
    finally:
        engine.close()


def config_params(steps: int, timeout: float | None = None):
    from omni_core.config import SamplingParams

    return SamplingParams.from_kwargs(height=32, width=32, num_inference_steps=steps, timeout=timeout, seed=1)


def test_a_caller_is_answered_while_a_long_request_mode_wave_runs(tiny_model):
    """The loop never runs the model: admission, stats and a waiting request's abort answer at once while a
    whole-request wave runs (before, they waited for the lock the loop held between waves, or for the wave)."""
    config = OmniDiffusionConfig.from_kwargs(model=tiny_model, warmup=False, max_num_seqs=1)
    engine = DiffusionEngine(config)
    try:
        pipe = engine.executor.runner.pipeline
        started, release = threading.Event(), threading.Event()
        step = pipe.denoise_step

        def slow_step(states):
            started.set()
            release.wait(30)
            return step(states)

        pipe.denoise_step = slow_step
        (running,) = engine.submit([OmniDiffusionRequest(prompt="a", sampling_params=config_params(steps=2))])
        assert started.wait(30)
        t0 = time.monotonic()
        (waiting,) = engine.submit([OmniDiffusionRequest(prompt="b", sampling_params=config_params(steps=2))])
        stats = engine.stats()
        engine.abort(waiting.request_id)
        out = waiting.result(timeout=5)
        elapsed = time.monotonic() - t0
        release.set()
        assert out.status == "aborted" and stats["running"] == 1 and stats["waiting"] == 1
        assert elapsed < 2.0, f"the caller waited {elapsed:.2f} s for a loop busy with a wave"
        assert running.result(timeout=30).status == "completed"
    finally:
        release.set()
        engine.close()

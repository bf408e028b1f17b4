"""The fault matrix (``omni_core/testing/fault_matrix.py``, shown in docs/faults.md): a server per layout, a process
killed or an out-of-memory error injected, idle and under 16 concurrent clients, and each cell checks exactly what
its promise says. The server's own death is a real ``omni serve`` killed; a worker's or a stage's death and the
out-of-memory errors strike the same app over an engine in this process (its fork server is warm: no interpreter to
start per cell). Kills need a server each; the out-of-memory cells of one layout share one (it survives them, which
is the point)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from omni_core.testing.fault_matrix import (ANSWER_WITHIN_S, CELLS, GONE_WITHIN_S, LOAD_CLIENTS, MEMORY_SLACK_BYTES,
                                            FaultCell, core_cells, render_table)
from omni_core.testing.processes import alive, cmdline, name
from omni_core.testing.serve_process import EmbeddedServer, ServeProcess, leaked_shm, port_is_free
from omni_core.testing import wait_for

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parents[2]
#: the test pipeline's steps sleep this long per request (16 requests x 40 steps: ~3 s of work in flight)
SLEEP_S = 0.005
STEPS = 40


def server_args(layout: str) -> list[str]:
    args = ["--no-warmup", "--max-steps", "1000"]
    if layout == "uni":
        return [*args, "--executor", "uni"]
    if layout == "mp":
        return [*args, "--executor", "mp"]
    if layout == "mp-cfg2":
        return [*args, "--executor", "mp", "--parallel-config", json.dumps({"cfg_parallel_size": 2})]
    if layout == "stages":
        return [*args, "--executor", "mp", "--encode-workers", "1", "--decode-workers", "1"]
    raise AssertionError(layout)


def body(layout: str, i: int, **extra_args) -> dict:
    if layout == "stages":  # shapes declares its stages; the test pipeline does not
        return {"prompt": "a red circle in the top left", "num_inference_steps": 300, "size": "32x32", "seed": i}
    out = {"prompt": f"client {i}", "num_inference_steps": STEPS, "seed": i,
           "extra_args": {"sleep_per_step": SLEEP_S, **extra_args}}
    if layout == "mp-cfg2":
        out["guidance_scale"] = 2.0  # both ranks take part
    return out


def start(layout: str, tiny_model: str) -> ServeProcess:
    """``omni serve`` for ``layout``, in a subprocess."""
    return ServeProcess("shapes" if layout == "stages" else tiny_model, *server_args(layout))


def embedded(layout: str, tiny_model: str) -> EmbeddedServer:
    """The same app and layout over an engine in this process."""
    kwargs = {"warmup": False, "limits": {"max_steps": 1000}, "executor": "uni" if layout == "uni" else "mp"}
    if layout == "mp-cfg2":
        kwargs["parallel_config"] = {"cfg_parallel_size": 2}
    if layout == "stages":
        kwargs.update(encode_workers=1, decode_workers=1)
    return EmbeddedServer("shapes" if layout == "stages" else tiny_model, **kwargs)


def by_name(server: EmbeddedServer, process: str) -> int:
    """The PID of the engine's process called ``process`` (Omni names its processes)."""
    found = [p for p in server.processes() if name(p) == process]
    assert len(found) == 1, f"{process!r} among the engine's processes: {[(p, name(p)) for p in server.processes()]}"
    return found[0]


def admitted(server: ServeProcess, n: int) -> None:
    wait_for(lambda: (server.metric("omni_engine_requests_total", outcome="added") or 0) >= n,
             timeout=120, what=f"{n} requests admitted")


def assert_nothing_left(server: ServeProcess | EmbeddedServer, below: list[int]) -> None:
    """The server (a subprocess) and every process below it gone within the bound, no new shared-memory segment,
    the port free."""
    if isinstance(server, ServeProcess):
        assert server.wait_exit(GONE_WITHIN_S) is not None, "the server outlived the fault"
    deadline = time.monotonic() + GONE_WITHIN_S
    while any(alive(p) for p in below):
        assert time.monotonic() < deadline, \
            f"processes {[(p, cmdline(p)) for p in below if alive(p)]} outlived their server by {GONE_WITHIN_S} s"
        time.sleep(0.1)
    wait_for(lambda: not leaked_shm(below), "no shared-memory segment of theirs left in /dev/shm", timeout=5)
    assert port_is_free(server.port)


def kill_target(cell: FaultCell) -> str | None:
    return {"kill-worker": "omni-worker-0", "kill-encode": "omni-encode", "kill-decode": "omni-decode"}.get(cell.fault)


KILL_CELLS = [c for c in core_cells() if c.fault.startswith("kill-")]
OOM_CELLS = [c for c in core_cells() if c.fault.startswith("oom-")]


@pytest.mark.parametrize("cell", KILL_CELLS, ids=[c.id for c in KILL_CELLS])
def test_kill_cell(cell: FaultCell, tiny_model):
    target = kill_target(cell)
    server = start(cell.layout, tiny_model) if target is None else embedded(cell.layout, tiny_model)
    try:
        below = server.processes()[1:] if target is None else server.processes()
        n = LOAD_CLIENTS if cell.load == "load" else 0
        clients = server.clients([body(cell.layout, i) for i in range(n)])
        if n:
            admitted(server, n)
        if target is None:  # the server itself
            server.kill()
        else:
            os.kill(by_name(server, target), signal.SIGKILL)
        killed = time.monotonic()
        answers = clients.answers(timeout=ANSWER_WITHIN_S + 30)
        late = [t - killed for t in clients.done_at if t - killed > ANSWER_WITHIN_S]
        assert not late, f"answers came {late} s after the fault (bound {ANSWER_WITHIN_S} s)"
        if target is None:
            assert all(isinstance(a, Exception) for a in answers), answers  # cut connections, not hangs
        else:
            what = {"omni-worker-0": "exited with code -9", "omni-encode": "encode stage",
                    "omni-decode": "decode stage"}[target]
            for a in answers:
                assert not isinstance(a, Exception) and a.status_code == 503, a
                err = a.json()["error"]
                assert err["code"] == "engine_dead" and what in err["message"], err
            later = server.post(body(cell.layout, 99), timeout=ANSWER_WITHIN_S)
            assert isinstance(later, Exception) or (later.status_code == 503
                                                    and later.json()["error"]["code"] == "engine_dead"), later
            code, health = server.health()
            assert code == 503 and health["status"] == "dead" and what in health["reason"], (code, health)
            assert server.metric("omni_engine_dead") == 1
            server.close()  # what omni serve does on its engine's death (tests/serve/test_cli_serve.py: it exits 3)
        assert_nothing_left(server, below)
    finally:
        server.close()


@pytest.fixture(scope="module")
def oom_servers(tiny_model):
    """One server per layout for the out-of-memory cells (each survives them)."""
    servers: dict[str, EmbeddedServer] = {}

    def get(layout: str) -> EmbeddedServer:
        if layout not in servers:
            servers[layout] = embedded(layout, tiny_model)
            assert servers[layout].post(body(layout, 0)).status_code == 200  # warm: the memory level to return to
        return servers[layout]

    yield get
    for server in servers.values():
        server.close()


@pytest.mark.parametrize("cell", OOM_CELLS, ids=[c.id for c in OOM_CELLS])
def test_out_of_memory_cell(cell: FaultCell, oom_servers):
    server = oom_servers(cell.layout)
    inject = {"oom_at_step": 2, **({"fail_on_rank": 1} if cell.fault == "oom-rank" else {})}
    counted = server.metric("omni_engine_requests_out_of_memory_total")
    rss_before = server.rss_bytes()
    n = LOAD_CLIENTS if cell.load == "load" else 1
    doomed = n // 3
    t0 = time.monotonic()
    answers = server.clients([body(cell.layout, i, **(inject if i == doomed else {})) for i in range(n)]).answers(
        timeout=ANSWER_WITHIN_S + 60)
    bad = answers[doomed]
    assert not isinstance(bad, Exception) and bad.status_code == 500, bad
    err = bad.json()["error"]
    assert err["code"] == "out_of_memory", err
    if cell.fault == "oom-rank":
        assert "rank 1 of this replica ran out of memory" in err["message"], err
    others = [a for i, a in enumerate(answers) if i != doomed]
    assert all(not isinstance(a, Exception) and a.status_code == 200 for a in others), others
    assert time.monotonic() - t0 < ANSWER_WITHIN_S + 10 * (n > 1)  # the others' own work, then the retry
    assert server.metric("omni_engine_requests_out_of_memory_total") == counted + 1
    if n == 1:  # nothing completed since: degraded, still serving
        code, health = server.health()
        assert code == 200 and health["status"] == "degraded" and "out of memory" in health["reason"], health
        assert server.metric("omni_engine_degraded") == 1
    # under load the doomed request may also be the last to end (its batch is retried one by one after the
    # others' waves): degraded until a request completes after it, whichever order the burst ended in
    assert server.post(body(cell.layout, 7)).status_code == 200
    code, health = server.health()
    assert code == 200 and health["status"] == "ok" and health["waiting"] == health["running"] == 0, health
    assert server.metric("omni_engine_degraded") == 0
    assert server.rss_bytes() <= rss_before + MEMORY_SLACK_BYTES


def test_every_core_cell_runs_here_and_the_docs_carry_the_table():
    assert {c.id for c in core_cells()} == {c.id for c in KILL_CELLS + OOM_CELLS}
    assert len({c.id for c in CELLS}) == len(CELLS)
    for cell in CELLS:  # a plugin's cells name a test that exists and runs both loads
        if cell.test != "core":
            path, _, name = cell.test.partition("::")
            text = (ROOT / path).read_text()
            assert f"def {name}(" in text and '@pytest.mark.parametrize("load", ["idle", "load"])' in text, cell
    import importlib.util

    spec = importlib.util.spec_from_file_location("doc_tables", ROOT / "scripts" / "doc_tables.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    doc = (ROOT / "docs" / "faults.md").read_text()
    assert mod.current(doc, "fault-matrix") == render_table(), "docs/faults.md is stale: run scripts/doc_tables.py"

"""A server for tests that kill things: ``omni serve`` for real in a subprocess (:class:`ServeProcess`), or the same
app over an engine in this process (:class:`EmbeddedServer`: no interpreter to start, the fork server already warm).
Both start, give their URL, health and metrics, send many clients at once, and say which processes are theirs.

    with ServeProcess("shapes", "--executor", "mp") as srv:
        answers = srv.clients([body] * 16)
"""

from __future__ import annotations

import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from omni_core.testing.processes import alive, descendants


def omni_command() -> list[str]:
    """The installed ``omni`` console script (the real entry point), or ``python -m omni_core.cli``."""
    script = Path(sys.executable).parent / "omni"
    return [str(script)] if script.exists() else [sys.executable, "-m", "omni_core.cli"]


def shm_entries() -> set[str]:
    """Names in ``/dev/shm`` (shared-memory segments and named semaphores); empty where there is none."""
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def leaked_shm(pids: list[int]) -> set[str]:
    """Shared-memory segments of these (dead) processes still in ``/dev/shm``: torch names its segments
    ``torch_<pid>_...``. Named semaphores carry no PID: multiprocessing's resource tracker unlinks a dead process's
    ones when it exits, so "the server's resource tracker exited" is their check (it is one of the processes that
    must be gone)."""
    prefixes = tuple(f"torch_{pid}_" for pid in pids)
    return {n for n in shm_entries() if n.startswith(prefixes)} if prefixes else set()


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class _HTTP:
    """What both servers share: requests to ``self.url``, health, metrics, client threads."""

    url = ""

    def get(self, path: str, timeout: float = 10.0) -> Any:
        """``GET path`` (an ``httpx.Response``), or the connection error it raised."""
        import httpx

        try:
            return httpx.get(self.url + path, timeout=timeout)
        except httpx.HTTPError as exc:
            return exc

    def health(self) -> tuple[int | None, dict]:
        """(status code, body) of ``/health``; (None, {}) when nothing answers."""
        r = self.get("/health")
        return (None, {}) if isinstance(r, Exception) else (r.status_code, r.json())

    def metric(self, name: str, **labels: str) -> float | None:
        """One sample of ``/metrics`` (the first whose labels include ``labels``), or None."""
        r = self.get("/metrics")
        if isinstance(r, Exception):
            return None
        for line in r.text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                if all(f'{k}="{v}"' in line for k, v in labels.items()):
                    return float(line.rsplit(" ", 1)[1])
        return None

    def post(self, body: dict, timeout: float = 120.0, path: str = "/v1/images/generations") -> Any:
        """``POST`` a generation: the ``httpx.Response``, or the exception the client got instead."""
        import httpx

        try:
            return httpx.post(self.url + path, json=body, timeout=timeout)
        except httpx.HTTPError as exc:
            return exc

    def clients(self, bodies: list[dict], timeout: float = 120.0) -> "Clients":
        """Every body sent at once, one client thread each (started; ``.answers()`` waits for them)."""
        return Clients(self, bodies, timeout)


class ServeProcess(_HTTP):
    """``omni serve MODEL ARGS...`` on a free port, its stderr kept in a file (a pipe nobody reads would block
    it); ``OMNI_*`` switches other than ``OMNI_STRICT_PLUGINS`` are not inherited."""

    def __init__(self, model: str, *args: str, timeout: float = 180.0, env: dict[str, str] | None = None,
                 log_dir: str | None = None) -> None:
        import tempfile

        base = {k: v for k, v in os.environ.items() if not k.startswith("OMNI_") or k == "OMNI_STRICT_PLUGINS"}
        base.update(env or {})
        self.log = tempfile.NamedTemporaryFile("w+", prefix="omni-serve-", suffix=".log", dir=log_dir, delete=False)
        self.proc = subprocess.Popen([*omni_command(), "serve", model, "--port", "0", "--log-level", "warning", *args],
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, env=base)
        self.url = ""
        deadline = time.monotonic() + timeout
        seen = []
        while not self.url:
            left = deadline - time.monotonic()
            if left <= 0 or self.proc.poll() is not None:
                self.kill()
                raise AssertionError(f"omni serve did not start (exit {self.proc.poll()}): {''.join(seen)}\n"
                                     f"{self.stderr()}")
            ready, _, _ = select.select([self.proc.stdout], [], [], min(left, 0.5))
            if ready:
                line = self.proc.stdout.readline()
                seen.append(line)
                m = re.search(r"on (http://\S+) ", line)
                if m:
                    self.url = m.group(1)
        self.port = int(self.url.rsplit(":", 1)[1])
        #: every process ever seen below the server (a killed server's children are re-parented: ``close`` still
        #: finds them)
        self.seen: set[int] = set(descendants(self.proc.pid))

    # ------------------------------------------------------------------ reading it
    def stderr(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")

    def processes(self) -> list[int]:
        """The server's process and every process below it (workers, stage processes, fork server, ...)."""
        if self.proc.poll() is not None:
            return []
        below = descendants(self.proc.pid)
        self.seen.update(below)
        return [self.proc.pid, *below]

    def rss_bytes(self) -> int:
        """Resident memory of the server and every process below it."""
        return sum(_rss(p) for p in self.processes())

    # ------------------------------------------------------------------ driving it
    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def wait_exit(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def close(self) -> None:
        """SIGINT (the graceful path), then SIGKILL for the server and anything left below it."""
        below = self.seen | set(descendants(self.proc.pid))
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            if self.wait_exit(30) is None:
                self.proc.kill()
                self.proc.wait()
        deadline = time.monotonic() + 10
        while any(alive(p) for p in below) and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in below:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.log.close()
        os.unlink(self.log.name)

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class EmbeddedServer(_HTTP):
    """``build_app`` over an engine of this process, served by :class:`~omni_core.serve.ServerThread` (what a notebook
    runs); its processes are the engine's (workers, stage processes). The engine is not closed on its death, so
    ``/health`` keeps saying why; ``close`` closes it."""

    def __init__(self, model: str, **engine_kwargs: Any) -> None:
        from omni_core.config import OmniDiffusionConfig
        from omni_core.engine import make_engine
        from omni_core.serve import ServerThread, build_app

        self.engine = make_engine(OmniDiffusionConfig.from_kwargs(model=model, **engine_kwargs))
        self.thread = ServerThread(build_app(self.engine))
        self.url = self.thread.url
        self.port = self.thread.port
        self.pid = os.getpid()

    def processes(self) -> list[int]:
        """The engine's worker and stage processes, as it started them (the dead ones included)."""
        if not hasattr(self, "_pids"):
            pids = list(getattr(self.engine.executor, "worker_pids", list)())
            pids += [s["pid"] for s in self.engine.stats().get("stages", {}).values() if s.get("pid")]
            self._pids = pids
        return list(self._pids)

    def rss_bytes(self) -> int:
        """Resident memory of this process and the engine's processes."""
        return sum(_rss(p) for p in [self.pid, *self.processes()] if alive(p))

    def close(self) -> None:
        self.thread.stop()
        self.engine.close()

    def __enter__(self) -> EmbeddedServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _rss(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


class Clients:
    """Client threads, one request each; ``answers()`` waits for all of them (each an ``httpx.Response`` or the
    exception its client got) and ``seconds`` says when each answer came, counted from ``t0``."""

    def __init__(self, server: _HTTP, bodies: list[dict], timeout: float) -> None:
        self.results: list[Any] = [None] * len(bodies)
        self.done_at: list[float] = [0.0] * len(bodies)
        self.t0 = time.monotonic()

        def one(i: int, body: dict) -> None:
            self.results[i] = server.post(body, timeout=timeout)
            self.done_at[i] = time.monotonic()

        self.threads = [threading.Thread(target=one, args=(i, b), daemon=True) for i, b in enumerate(bodies)]
        for t in self.threads:
            t.start()

    def answers(self, timeout: float = 180.0) -> list[Any]:
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        hung = sum(t.is_alive() for t in self.threads)
        assert not hung, f"{hung} of {len(self.threads)} clients got no answer within {timeout} s"
        return self.results


__all__ = ["Clients", "EmbeddedServer", "ServeProcess", "leaked_shm", "omni_command", "port_is_free", "shm_entries"]

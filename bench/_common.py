"""Shared set-up for the benchmarks: which model to run (the test pipeline plugin by default)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def tiny_test_model() -> str:
    """Install the test-only pipeline plugin into a temp dir (as the tests do) and save its tiny model."""
    target = tempfile.mkdtemp(prefix="omni-bench-site-")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target",
                    target, str(ROOT / "tests/fixtures/dists/omni-test-pipeline")], check=True)
    sys.path.insert(0, target)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (target, os.environ.get("PYTHONPATH")) if p)
    from omni_test_pipeline.pipeline import TinyTestPipeline

    path = tempfile.mkdtemp(prefix="omni-bench-model-")
    TinyTestPipeline.save(path)
    return path


def parser(doc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc)
    p.add_argument("--model", default=None, help="model name or folder (default: the tiny test pipeline)")
    p.add_argument("--steps", type=int, default=None, help="denoising steps per request (default: model default)")
    p.add_argument("--size", type=int, default=None, help="height and width (default: model default)")
    p.add_argument("--cpu-threads", type=int, default=None,
                   help="torch threads per model process, the same for every row (default: the engine's policy)")
    return p


def engine_config(args, **config) -> dict:
    """Engine keyword arguments every row of a benchmark shares: limits that admit ``--size``/``--steps``
    and the thread policy."""
    out = {"limits": limits(args), **config}
    if args.cpu_threads is not None:
        out["cpu_threads"] = args.cpu_threads
    return out


def thread_header(args) -> str:
    """The thread policy every row ran with, for the header."""
    import os

    from omni_core.config import OmniDiffusionConfig
    from omni_core.platforms.threads import thread_policy

    policy = thread_policy(OmniDiffusionConfig(model="-", cpu_threads=args.cpu_threads))
    return f"{policy}; load average {os.getloadavg()[0]:.2f}"


def resolve(args) -> str:
    return args.model or tiny_test_model()


def sampling(args, **extra):
    from omni_core import SamplingParams

    kw = {k: v for k, v in (("num_inference_steps", args.steps), ("height", args.size), ("width", args.size))
          if v is not None}
    return SamplingParams(**kw, **extra)


def limits(args) -> dict:
    """Engine limits that admit this run's ``--size``/``--steps`` (a benchmark may go past a model's defaults)."""
    out = {}
    if args.size is not None:
        out["max_pixels"] = args.size * args.size
    if args.steps is not None:
        out["max_steps"] = args.steps
    return out


class EngineProcess:
    """An ``AsyncOmni`` in a process of its own, driven over a pipe: ``burst(n, params)`` runs ``n`` concurrent
    requests there and returns the seconds they took.

    Why a process per engine: engines that share a process share its OpenMP runtime, and each engine's model
    thread keeps a team of torch threads. Once a process holds more OpenMP threads than the machine has cores,
    libgomp lets an idle thread spin only ~100 times (instead of ~300,000) before it sleeps, so every parallel
    region starts by waking its threads: on 2 cores one extra team made a ``shapes`` step 21% slower, and step
    mode (which leaves the model between steps) lost more than request mode (docs/benchmarks.md). A deployment
    runs one engine per process; so does each row here.
    """

    def __init__(self, model: str, config: dict) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        # not a daemon: an ``mp`` engine starts worker processes of its own
        self._proc = ctx.Process(target=_serve_engine, args=(child, model, config), name="bench-engine")
        self._proc.start()
        child.close()

    def wait_ready(self) -> None:
        self._reply()

    def burst(self, n: int, params, prompt: str = "prompt") -> float:
        self._conn.send(("burst", n, params, prompt))
        return self._reply()

    def _reply(self):
        try:
            kind, value = self._conn.recv()
        except EOFError:
            raise RuntimeError(f"the engine process exited (code {self._proc.exitcode})") from None
        if kind == "error":
            raise RuntimeError(f"the engine process failed:\n{value}")
        return value

    def close(self) -> None:
        try:
            self._conn.send(("close",))
            self._proc.join(60)
        except (BrokenPipeError, OSError):
            pass
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(10)


def _serve_engine(conn, model: str, config: dict) -> None:
    """The engine process of :class:`EngineProcess`: one ``AsyncOmni``, commands from ``conn`` until it closes
    (or the benchmark's process dies: ``recv`` then raises ``EOFError``)."""
    import asyncio
    import time
    import traceback

    async def burst(omni, n: int, params, prompt: str) -> float:
        async def one(i):
            async for _ in omni.generate(f"{prompt} {i}", params.replace(seed=i)):
                pass

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(n)))
        return time.perf_counter() - t0

    async def go() -> None:
        from omni_core import AsyncOmni

        omni = AsyncOmni(model, **config)
        try:
            conn.send(("ok", None))
            while True:
                try:
                    cmd = conn.recv()
                except EOFError:
                    return
                if cmd[0] == "close":
                    return
                try:
                    conn.send(("ok", await burst(omni, *cmd[1:])))
                except Exception:  # noqa: BLE001 - reported to the benchmark, which stops
                    conn.send(("error", traceback.format_exc()))
                    return
        finally:
            await omni.close()

    try:
        asyncio.run(go())
    except Exception:  # noqa: BLE001 - the engine failed to start
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass

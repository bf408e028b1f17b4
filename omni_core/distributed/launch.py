"""Run a function on N local processes joined by ``torch.distributed`` (tests, benchmarks, demos).

``spawn_workers("path/to/file.py:fn", 4)`` starts 4 processes (Omni's start method: :mod:`omni_core.processes`), joins them into a process group
(gloo by default) on a free localhost port, calls ``fn(rank, world_size, *args)`` in each, and returns the
per-rank return values (which must pickle). A failing rank ends the others and the parent raises with every
failed rank's traceback (the first rank noticed may only be a victim of another's failure); a run that
exceeds ``timeout`` is terminated. Every child destroys its process group on exit.
"""

from __future__ import annotations

import datetime
import importlib.util
import os
import pickle
import socket
import sys
import tempfile
import time
import traceback
from typing import Any, Callable


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _resolve(target: str | Callable) -> Callable:
    if callable(target):
        return target
    path, _, attr = target.rpartition(":")
    if path.endswith(".py"):
        name = "_omni_spawned_" + os.path.splitext(os.path.basename(path))[0]
        module = sys.modules.get(name)
        if module is None:
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
        return getattr(module, attr)
    import pkgutil

    return pkgutil.resolve_name(target)


def _child(rank: int, world_size: int, port: int, target: Any, args: tuple, result_dir: str, backend: str,
           threads: int, timeout: float, environment: dict[str, str]) -> None:
    from omni_core.processes import child_setup

    child_setup(None, environment)
    import torch
    import torch.distributed as dist

    if threads:
        torch.set_num_threads(threads)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout))
    try:
        result = _resolve(target)(rank, world_size, *args)
        with open(os.path.join(result_dir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
    except BaseException:
        with open(os.path.join(result_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        from omni_core.distributed.parallel_state import destroy_parallel_state

        destroy_parallel_state()
        dist.destroy_process_group()


def spawn_workers(target: str | Callable, world_size: int, args: tuple = (), *, timeout: float = 120.0,
                  backend: str = "gloo", threads: int = 1) -> list[Any]:
    """Run ``target(rank, world_size, *args)`` on ``world_size`` processes; return the results by rank.

    ``target`` is ``"path/to/file.py:name"``, ``"module:name"`` or a picklable function. ``threads`` sets
    ``torch.set_num_threads`` in each child (0 leaves torch's default), so N processes do not oversubscribe
    the cores.
    """
    import torch.multiprocessing as mp

    from omni_core.processes import child_environment, process_context, start_method

    process_context()  # the fork server's preload, when that is the start method
    with tempfile.TemporaryDirectory(prefix="omni_spawn_") as result_dir:
        ctx = mp.start_processes(_child, args=(world_size, free_port(), target, tuple(args), result_dir, backend,
                                               threads, timeout, child_environment()),
                                 nprocs=world_size, join=False, start_method=start_method())
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=0.2):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"spawn_workers: {world_size} processes running {target!r} did not finish "
                                       f"within {timeout:.0f} s")
        except Exception as exc:
            # the first rank torch notices may be a victim (its peer went away); report every rank's error
            time.sleep(0.5)
            errors = []
            for rank in range(world_size):
                path = os.path.join(result_dir, f"rank{rank}.err")
                if os.path.exists(path):
                    with open(path) as f:
                        errors.append(f"--- rank {rank} ---\n{f.read()}")
            if errors:
                raise RuntimeError(f"spawn_workers: {len(errors)} of {world_size} processes running {target!r} "
                                   f"failed:\n" + "\n".join(errors)) from exc
            raise
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
            for p in ctx.processes:
                p.join(5)
                if p.is_alive():
                    p.kill()
                    p.join()
        results = []
        for rank in range(world_size):
            with open(os.path.join(result_dir, f"rank{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results

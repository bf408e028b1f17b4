"""Facts about an accelerator that only its runtime can tell (free memory, whether a quantized kernel runs),
asked in a short-lived child process so that the engine's own process never initialises the device.

A CUDA context costs several hundred MiB on the GPU it opens on, for the life of the process; the engine process
of an ``mp`` or ``ray`` executor runs no model, so a context there is pure loss on rank 0's GPU (issue #36). The
platform and attention plugins already detect without one (NVML device counts); this module covers what
start-up checks (``performance_mode``, ``quantization``) need beyond that. The child runs
``python -m omni_core.optimize.probe_child DEVICE_TYPE INDEX``, prints one JSON line and exits, taking its
context with it. One probe per device type and index per process (cached).

A process whose device runtime is already initialised (a worker, or the ``uni`` executor's engine once its model
is loaded) and the child itself ask the device directly: :func:`probe_here`.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from typing import Any

#: set in the probe child: it asks the device itself
CHILD_ENV = "OMNI_DEVICE_PROBE_CHILD"
#: what the child runs (named, not imported: it imports the quantization probe, which imports this module)
CHILD_MODULE = "omni_core.optimize.probe_child"
#: seconds the child may take (importing torch and torchao, creating a context, running a tiny kernel)
PROBE_TIMEOUT_S = 180.0


def probe_here(device_type: str) -> bool:
    """Whether this process may touch ``device_type``'s runtime itself: always on CPU; else only in the probe
    child or where the runtime is initialised already (asking cannot then create a context)."""
    if device_type in ("cpu", "meta") or os.environ.get(CHILD_ENV) == "1":
        return True
    try:
        import torch
    except ImportError:
        return True
    module = getattr(torch, device_type, None)
    initialised = getattr(module, "is_initialized", None)
    return bool(initialised is not None and initialised())


def free_bytes_here(device_type: str, index: int) -> int:
    import torch

    return int(getattr(torch, device_type).mem_get_info(index)[0])


@functools.lru_cache(maxsize=None)
def device_facts(device_type: str, index: int = 0) -> dict[str, Any]:
    """``{"free_bytes": int, "methods": {method: [usable, reason]}}`` of device ``index`` of ``device_type``,
    asked in a child process; ``{"error": why}`` if the child could not tell (no device, a crash, a timeout)."""
    env = {**os.environ, CHILD_ENV: "1",
           "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # the engine's imports, e.g. a test's plugins
    cmd = [sys.executable, "-m", CHILD_MODULE, device_type, str(index)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, env=env,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return {"error": f"the {device_type} probe process did not answer within {PROBE_TIMEOUT_S:.0f} s"}
    except OSError as exc:
        return {"error": f"the {device_type} probe process could not start: {exc}"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                break
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return {"error": f"the {device_type} probe process failed (exit {proc.returncode}): {tail}"}


def free_memory_bytes(device_type: str, index: int = 0) -> int:
    """Free bytes on device ``index`` (0 if unknown), without initialising the runtime in this process."""
    if probe_here(device_type):
        try:
            return free_bytes_here(device_type, index)
        except Exception:  # noqa: BLE001 - a backend without mem_get_info: unknown
            return 0
    return int(device_facts(device_type, index).get("free_bytes", 0))

"""Pipeline stages apart from the denoiser: the VAE decode in a process of its own (``decode_workers=1``).

Why: in line, the denoiser waits while a finished request is decoded, and the VAE's weights sit next to the
denoiser's. Split, the model process loads the pipeline without its decode components (a config-only stand-in
keeps what the pipeline derives from them: ``vae_scale_factor``, the preview's VAE config), and when a request
finishes denoising it hands back a :class:`DecodePayload` (its final latents and the state fields decode reads)
instead of pixels; the engine sends it to the decode process, which loaded only the decode components, and
delivers what that process returns. The denoiser's next wave runs meanwhile.

The contract a model meets (docs/runtime.md "Stages"; :mod:`omni_core.worker.stage_contract`):
``stage_components`` says which components each stage needs (``{"decode": ("vae",), "encode": (...)}``; a ``DiffusersStepPipeline`` derives it from its folder's
``model_index.json``), and the pipeline's own ``post_decode_batch`` / ``post_decode`` read only the decode
components, ``state.latents``, ``state.request`` and plain (scalar) ``state.extra`` entries such as height and
width. A wave's finished requests are decoded together in the decode process exactly as they would have been in
line (one ``post_decode_batch`` call per call the runner made), so outputs are bit-equal.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from typing import Any, Callable

from omni_core.errors import EngineDeadError
from omni_core.worker.stage_contract import DECODE, DecodePayload, model_bytes_of_stage

logger = logging.getLogger("omni_core.worker")


# ---------------------------------------------------------------------------------------------- the process
def decode_main(config: Any, resolved: Any, in_q: Any, out_q: Any, parent_pid: int) -> None:
    """The decode process: load the decode components only, then decode each group it is sent."""
    from omni_core.worker.parent_watch import die_with_parent

    die_with_parent(parent_pid)  # first of all: never outlive the engine
    from omni_core.utils.quiet import quiet_optional_libraries

    quiet_optional_libraries()
    from omni_core.worker.mp_worker import BackgroundSender, _traceback

    sender = BackgroundSender(out_q)
    try:
        from omni_core.pipelines.loader import load_pipeline
        from omni_core.platforms import platform_for
        from omni_core.platforms.threads import apply_thread_policy
        from omni_core.utils.dtypes import torch_dtype

        platform = platform_for(config)
        apply_thread_policy(config, processes=config.world_size)  # the in-line decode's threads: the same sums
        device = platform.get_torch_device(0)
        platform.set_device(device)
        pipeline = load_pipeline(resolved, config, device, torch_dtype(config, platform), stage=DECODE)
        sender.put(("ready", model_bytes_of_stage(pipeline)))
    except BaseException:  # noqa: BLE001 - reported to the engine
        sender.put(("fatal", _traceback()))
        sender.close()
        return
    dropped: set[str] = set()
    while True:
        msg = in_q.get()
        if msg[0] == "shutdown":
            break
        if msg[0] == "abort":
            dropped.update(msg[1])
            continue
        payloads = [p for p in msg[1] if p.request_id not in dropped]
        dropped.difference_update(p.request_id for p in msg[1])
        if payloads:
            sender.put(("done", _decode(pipeline, platform, device, payloads)))
    sender.close()
    from multiprocessing import util

    util._exit_function()  # multiprocessing's own exit work (semaphores such as tqdm's lock), as the model workers
    os._exit(0)  # skip the interpreter's teardown (seconds with torch loaded), as the model workers do


def _decode(pipeline: Any, platform: Any, device: Any, payloads: list[DecodePayload]) -> Any:
    """One group decoded as the runner would have in line (a failing batch retried one by one), outputs packed
    for the trip back."""
    import torch

    from omni_core.waves import RunnerOutput
    from omni_core.worker.failures import batched_then_one_by_one, error_output
    from omni_core.worker.transport import pack_outputs

    states = [p.state(device) for p in payloads]
    try:
        platform.reset_peak_memory(device)
    except Exception:  # noqa: BLE001 - a platform that cannot tell
        pass
    t0 = time.perf_counter()
    try:
        with torch.inference_mode():
            results = batched_then_one_by_one(states, pipeline.post_decode_batch, pipeline.post_decode,
                                              lambda state, exc: exc, what="post_decode")
    except Exception as exc:  # noqa: BLE001
        results = [exc] * len(states)
    elapsed = time.perf_counter() - t0
    try:
        peak = round(platform.peak_memory_bytes(device) / 2**20, 1)
    except Exception:  # noqa: BLE001
        peak = 0.0
    outputs = {}
    for state, result in zip(states, results):
        if isinstance(result, Exception):
            result = error_output(state.request_id, RuntimeError(f"decode stage: {type(result).__name__}: {result}"),
                                  state)
        result.request_id = state.request_id
        result.metrics.update({"decode_time_s": elapsed, "decode_batch_size": len(states),
                               "decode_peak_memory_mb": peak})
        outputs[state.request_id] = result
    return pack_outputs(RunnerOutput(outputs=outputs))


# ---------------------------------------------------------------------------------------------- the engine's end
class DecodeStage:
    """The engine's handle on its decode process: ``submit`` groups, results reach ``on_done(outputs)`` from a
    reader thread; the process's death (not at shutdown) reaches ``on_dead(reason)`` once, the reason naming
    the stage. The process is started from the monitor thread, which lives until it exits, so it dies with the
    engine's process (``parent_watch``: the death signal follows the starting thread)."""

    def __init__(self, config: Any, resolved: Any, on_done: Callable[[dict], None],
                 on_dead: Callable[[str], None]) -> None:
        self.config, self.resolved = config, resolved
        self.on_done, self.on_dead = on_done, on_dead
        self.model_bytes: dict[str, int] = {}
        self.dead: str | None = None
        self._closing = False
        self.decoded = 0

    def start(self) -> None:
        import torch.multiprocessing as tmp

        from omni_core.worker.mp_worker import BackgroundSender

        ctx = tmp.get_context("spawn")
        self._in, self._out = ctx.SimpleQueue(), ctx.SimpleQueue()
        self.proc = ctx.Process(target=decode_main, name="omni-decode-stage", daemon=True,
                                args=(self.config, self.resolved, self._in, self._out, os.getpid()))
        self._sender = BackgroundSender(self._in)  # a put never blocks the engine's thread
        self._ready: queue.SimpleQueue = queue.SimpleQueue()
        self._monitor = threading.Thread(target=self._start_and_watch, name="omni-decode-monitor", daemon=True)
        self._monitor.start()
        try:
            kind, value = self._ready.get(timeout=self.config.worker_start_timeout)
        except queue.Empty:
            kind, value = "fatal", f"it did not load within {self.config.worker_start_timeout} s"
        if kind != "ready":
            self.shutdown()
            raise EngineDeadError(f"the decode stage's process failed to start: {value} (see its traceback above; "
                                  f"processes are started with spawn: a script that creates the engine at module "
                                  f"level must guard it with `if __name__ == '__main__':`)")
        self.model_bytes = value

    def _start_and_watch(self) -> None:
        import multiprocessing.connection

        try:
            self.proc.start()
        except BaseException as exc:  # noqa: BLE001 - handed to start()
            self._ready.put(("fatal", repr(exc)))
            return
        reader = threading.Thread(target=self._read, name="omni-decode-reader", daemon=True)
        reader.start()
        multiprocessing.connection.wait([self.proc.sentinel])
        self.proc.join(1)
        reason = (f"the decode stage's process (pid {self.proc.pid}) exited with code {self.proc.exitcode}")
        self._ready.put(("fatal", reason))  # read only while starting
        if not self._closing and self.dead is None:
            self.dead = reason
            logger.error("%s", reason)
            self.on_dead(reason)

    def _read(self) -> None:
        from omni_core.worker.transport import unpack_outputs

        while True:
            try:
                msg = self._out.get()
            except Exception:  # noqa: BLE001 - the process's end of the pipe is gone
                return
            if msg[0] == "ready":
                self._ready.put(("ready", msg[1]))
            elif msg[0] == "fatal":
                self._ready.put(("fatal", msg[1]))
            elif msg[0] == "done":
                outputs = unpack_outputs(msg[1]).outputs
                self.decoded += len(outputs)
                try:
                    self.on_done(outputs)
                except Exception:  # noqa: BLE001 - a delivery bug must not stop the reader
                    logger.exception("delivering decoded outputs failed")

    def submit(self, payloads: list[DecodePayload]) -> None:
        self._sender.put(("decode", payloads))

    def abort(self, request_ids: list[str]) -> None:
        self._sender.put(("abort", list(request_ids)))

    def pid(self) -> int | None:
        proc = getattr(self, "proc", None)
        return proc.pid if proc is not None else None

    def shutdown(self) -> None:
        self._closing = True
        proc = getattr(self, "proc", None)
        if proc is None or proc.pid is None:  # never started
            return
        sender = getattr(self, "_sender", None)
        if sender is not None and proc.is_alive():
            sender.put(("shutdown",))
            sender.close(timeout=2)
        proc.join(5)
        if proc.is_alive():
            proc.terminate()
            proc.join(3)
        if proc.is_alive():
            proc.kill()
            proc.join(2)
        self._monitor.join(5)


def start_decode_stage(config: Any, resolved: Any, on_done: Callable[[dict], None],
                       on_dead: Callable[[str], None]) -> DecodeStage | None:
    """The decode stage of ``config`` started (None with ``decode_workers=0``)."""
    if not getattr(config, "decode_workers", 0):
        return None
    stage = DecodeStage(config, resolved, on_done, on_dead)
    stage.start()
    return stage


__all__ = ["DecodeStage", "decode_main", "start_decode_stage"]

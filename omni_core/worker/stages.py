"""Pipeline stages apart from the denoiser: the VAE decode in a process of its own (``decode_workers=1``).

Why: in line, the denoiser waits while a finished request is decoded, and the VAE's weights sit next to the
denoiser's. Split, the model process loads the pipeline without its decode components (a config-only stand-in
keeps what the pipeline derives from them: ``vae_scale_factor``, the preview's VAE config), and when a request
finishes denoising it hands back a :class:`DecodePayload` (its final latents and the state fields decode reads)
instead of pixels; the engine sends it to the decode process, which loaded only the decode components, and
delivers what that process returns. The denoiser's next wave runs meanwhile.

The contract a model meets (docs/runtime.md "Stages"): ``stage_components`` says which components each stage
needs (``{"decode": ("vae",), "encode": (...)}``; a ``DiffusersStepPipeline`` derives it from its folder's
``model_index.json``), and the pipeline's own ``post_decode_batch`` / ``post_decode`` read only the decode
components, ``state.latents``, ``state.request`` and plain (scalar) ``state.extra`` entries such as height and
width. A wave's finished requests are decoded together in the decode process exactly as they would have been in
line (one ``post_decode_batch`` call per call the runner made), so outputs are bit-equal.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import queue
import threading
import time
from typing import Any, Callable

import attrs

from omni_core.errors import ConfigError, EngineDeadError

logger = logging.getLogger("omni_core.worker")

DECODE = "decode"
ENCODE = "encode"
STAGES = (ENCODE, DECODE)


# ---------------------------------------------------------------------------------------------- the contract
def declared_stages(pipeline_cls: type, model_path: str | None) -> dict[str, tuple[str, ...]]:
    """``{stage: component names}`` the pipeline declares (``stage_components``, a dict, or a classmethod
    ``stage_components_for(model_path)``); empty where it declares none."""
    derive = getattr(pipeline_cls, "stage_components_for", None)
    found = derive(model_path) if callable(derive) else getattr(pipeline_cls, "stage_components", None)
    return {k: tuple(v) for k, v in dict(found or {}).items()}


def check_stage_config(config: Any, pipeline_cls: type, model_path: str | None) -> None:
    """Refuse, by field, a ``decode_workers`` that cannot run: before any process starts."""
    if not getattr(config, "decode_workers", 0):
        return
    why = None
    if DECODE not in declared_stages(pipeline_cls, model_path):
        why = (f"pipeline {pipeline_cls.__name__} declares no decode components (stage_components['decode']), so "
               f"its decode cannot be loaded apart")
    elif config.world_size != 1:
        why = ("several model ranks decode together (the parallel VAE decode splits the VAE across them); a "
               "decode process apart is built for one model process")
    elif getattr(config, "offload", None) not in (None, "none"):
        why = ("offload moves the whole pipeline's components in turn on the model's device; with the decode "
               "apart there is nothing of the VAE left to offload, and its own process would hold it whole")
    elif getattr(config, "executor", None) not in (None, "uni", "mp"):
        why = f"executor {config.executor!r} may run the model on another host; the decode process runs on this one"
    if why is not None:
        raise ConfigError(f"decode_workers={config.decode_workers} cannot run here: {why}. Use decode_workers=0",
                          field="decode_workers")


def config_only_component(model_path: str, name: str, library: str, class_name: str, dtype: Any) -> Any:
    """A stand-in for component ``name`` that holds its folder config and no weights: an instance of a subclass
    of the real class (so diffusers' loader accepts it and the pipeline derives ``vae_scale_factor`` and the
    like from it), with one empty buffer for its dtype and device; config entries read as attributes, as the
    real module sets them in ``__init__`` (``temperal_downsample``)."""
    import importlib

    import torch
    from diffusers.configuration_utils import FrozenDict

    klass = getattr(importlib.import_module(library), class_name)
    config = klass.load_config(model_path, subfolder=name)

    def __getattr__(self: Any, attr: str) -> Any:
        try:
            return torch.nn.Module.__getattr__(self, attr)
        except AttributeError:
            values = self.__dict__.get("_internal_dict") or {}
            if attr in values:
                return values[attr]
            raise

    stand_in = type(class_name, (klass,), {"__getattr__": __getattr__, "__module__": klass.__module__,
                                           "__qualname__": class_name, "omni_config_only": True})
    obj = stand_in.__new__(stand_in)
    torch.nn.Module.__init__(obj)
    obj.register_to_config(**klass.extract_init_dict(config)[0])
    obj._internal_dict = FrozenDict({**obj._internal_dict, **{k: v for k, v in config.items() if k.startswith("_")}})
    obj.register_buffer("omni_config_only_dtype", torch.empty(0, dtype=dtype))
    return obj


def diffusers_stage_kwargs(model_path: str, stage: str, components: dict[str, tuple[str, ...]], dtype: Any
                           ) -> dict[str, Any]:
    """``from_pretrained`` keyword arguments of a diffusers folder for one side of the split: ``"denoise"``
    loads everything but the decode components (config-only stand-ins), ``"decode"`` only them."""
    with open(os.path.join(model_path, "model_index.json")) as f:
        index = json.load(f)
    names = {k: tuple(v) for k, v in index.items() if not k.startswith("_") and isinstance(v, list) and len(v) == 2
             and v[0] is not None}
    decode = set(components.get(DECODE, ()))
    if stage != DECODE:
        return {n: config_only_component(model_path, n, *names[n], dtype) for n in decode if n in names}
    # the decode side: the other weights stay unread. A diffusers model (a denoiser) becomes a config-only
    # stand-in, since pipelines read their config at construction (Wan: the expert's in_channels); another
    # library's model (a text encoder) is left out; what holds no weights (scheduler, tokenizer) loads as usual
    import importlib

    import torch

    kwargs: dict[str, Any] = {}
    for name, (library, class_name) in names.items():
        if name in decode:
            continue
        klass = getattr(importlib.import_module(library), class_name, None)
        if not (isinstance(klass, type) and issubclass(klass, torch.nn.Module)):
            continue
        kwargs[name] = (config_only_component(model_path, name, library, class_name, dtype)
                        if library == "diffusers" and hasattr(klass, "load_config") else None)
    return kwargs


def model_bytes_of_stage(pipeline: Any) -> dict[str, int]:
    """``stats()["model_bytes"]`` of a split process: its components less the config-only stand-ins."""
    from omni_core.optimize.components import components_of, module_bytes

    return {name: module_bytes(m) for name, m in components_of(pipeline).items()
            if not getattr(m, "omni_config_only", False)}


# ---------------------------------------------------------------------------------------------- the payload
def _plain(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))


@attrs.define
class DecodePayload:
    """What the decode stage needs of a finished request: its final latents, request and plain state fields.
    Rides in ``DiffusionOutput.tensor`` from the model process to the engine (pending decode); ``group`` and
    ``group_size`` keep the requests one ``post_decode_batch`` call decoded together in line together."""

    request: Any
    latents: Any
    step_index: int
    num_steps: int
    extra: dict
    group: str = ""
    group_size: int = 1

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @classmethod
    def of(cls, state: Any, group: str, group_size: int) -> DecodePayload:
        latents = state.latents.detach().to("cpu") if state.latents is not None else None
        return cls(request=state.request, latents=latents, step_index=state.step_index, num_steps=state.num_steps,
                   extra={k: v for k, v in state.extra.items() if _plain(v)}, group=group, group_size=group_size)

    def state(self, device: Any) -> Any:
        from omni_core.pipelines.state import StepState

        latents = self.latents.to(device) if self.latents is not None else None
        return StepState(request=self.request, latents=latents, step_index=self.step_index,
                         num_steps=self.num_steps, extra=dict(self.extra))


_groups = itertools.count()


def defer_decode(pipeline: Any) -> None:
    """Make ``pipeline``'s decode hand back payloads (both execution modes go through ``post_decode_batch``)."""
    from omni_core.outputs import DiffusionOutput

    def post_decode_batch(states: list) -> list:
        group = f"{os.getpid()}-{next(_groups)}"
        return [DiffusionOutput(request_id=s.request_id, tensor=DecodePayload.of(s, group, len(states)),
                                finished=True, step_index=s.step_index, num_steps=s.num_steps) for s in states]

    pipeline.post_decode_batch = post_decode_batch
    pipeline.post_decode = lambda state: post_decode_batch([state])[0]


def pending_decode(out: Any) -> bool:
    return isinstance(getattr(out, "tensor", None), DecodePayload)


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


__all__ = ["DECODE", "ENCODE", "DecodePayload", "DecodeStage", "check_stage_config", "config_only_component",
           "declared_stages", "defer_decode", "diffusers_stage_kwargs", "model_bytes_of_stage", "pending_decode",
           "start_decode_stage"]

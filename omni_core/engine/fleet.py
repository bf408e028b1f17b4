"""``ModelFleet``: several models behind one server, sharing one device within a memory budget.

Each served model has its own engine (its own worker processes, so one model's death fails only its requests) and
one :class:`Slot` here, the single owner of where that model is:

* ``cold``: no engine; bringing it in loads it from disk (workers start, weights are read);
* ``device``: its engine runs with its weights on the device;
* ``host``: its engine runs but its weights were moved to host copies (``release_memory``); bringing it back is a
  copy (``resume_memory``), no process start and no disk read;
* ``loading``: coming onto the device (a load, or a restore from host memory), once the models it evicts are out;
* ``evicting``: leaving the device (to host copies, or unloaded); ``unloading``: its host copies being dropped;
* ``dead``: its engine died; restarted on the next request, or reported dead (``Residency.restart``).

A request takes a **lease** on its model (:meth:`ModelFleet.lease`) while it is admitted; once admitted the
model's engine tracks it, and an eviction goes through the engine's weight gate (``release_memory`` with
``in_flight="finish"``), which waits for what it tracks: no eviction ever takes a model with work in flight. Room is
made by evicting idle, unpinned models least recently used first; when busy models hold the budget the policy
waits (up to ``wait_timeout_s``) or fails with :class:`~omni_core.errors.ResidencyError` naming them.

What a model charges against the device budget: the bytes its pipeline holds (measured in the model process after
each load, ``ModelRunner.memory_held``; before the first load, the size of its weight files) plus its working
memory (``FleetModel.working_memory``; default a quarter of the weights, a margin as ComfyUI reserves one). On the
CPU the "device" is the model processes' memory, and the host copy sits outside the pipeline: the same mechanism,
tested here.

Why our own code: no library keeps several diffusers pipelines within a budget with per-request leases (the
consumer tools that do, ComfyUI and InvokeAI, are applications, not libraries).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any, Callable, Iterator

import attrs

from omni_core.config.fleet import FleetConfig, FleetModel
from omni_core.engine.fleet_rules import (close_quietly, contention_error, is_idle, own_process, too_big,
                                          weight_file_bytes)
from omni_core.errors import ConfigError, EngineDeadError, ResidencyError

logger = logging.getLogger("omni_core.engine.fleet")

STATES = ("cold", "device", "host", "loading", "evicting", "unloading", "dead")
#: the states that count against the device budget (a loading model's room is reserved when it is chosen)
ON_DEVICE = ("device", "loading", "evicting")


@attrs.define
class Slot:
    """One served model and where it is; changed only under the fleet's lock."""

    entry: FleetModel
    plan: Any
    state: str = "cold"
    engine: Any = None
    #: bytes its pipeline held when last measured (the weight-file estimate before the first load)
    weight_bytes: int = 0
    measured: bool = False
    #: requests being admitted right now (a lease is held from the start of ``submit`` to its end)
    leases: int = 0
    #: bumped by every lease, so an idleness check made without the lock can tell it went stale
    uses: int = 0
    last_used: float = 0.0
    dead_reason: str | None = None
    #: the waiting model it drains for: it takes no new lease, and is evicted once its engine is idle
    drained_for: str | None = None
    #: loading, but the models it evicts are not out yet (its room is reserved; it holds nothing yet)
    reserved: bool = False
    loads: int = 0
    restores: int = 0

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def working_bytes(self) -> int:
        w = self.entry.working_memory
        return self.weight_bytes // 4 if w is None else w

    @property
    def charge(self) -> int:
        """What it counts against the device budget while there."""
        return self.weight_bytes + self.working_bytes


class ModelFleet:
    """The served models (see the module docstring). ``start(plan)`` builds one model's engine (default
    ``start_engine``); every model's options are planned, so refused, before any model loads."""

    def __init__(self, config: FleetConfig, *, start: Callable[[Any], Any] | None = None,
                 planner: Callable[[Any], Any] | None = None) -> None:
        from omni_core.config import OmniDiffusionConfig
        from omni_core.engine.engine import make_engine
        from omni_core.engine.plan import plan_engine

        self.config = config
        self.residency = config.residency
        self._start = start or make_engine
        self._lock = threading.Condition()
        self._closed = False
        self.slots: dict[str, Slot] = {}
        budget = self.residency.device_budget
        for entry in config.models:
            options = {**entry.options, "executor": own_process(entry, len(config.models))}
            try:
                plan = (planner or plan_engine)(OmniDiffusionConfig.from_kwargs(model=entry.model, **options))
            except ConfigError as exc:
                raise ConfigError(f"model {entry.name!r}: {exc}", field=exc.field) from None
            slot = Slot(entry=entry, plan=plan, weight_bytes=weight_file_bytes(plan.model_info.model_path))
            if budget is not None and slot.charge > budget:
                raise ConfigError(too_big(slot, budget, "its weight files"), field="device_budget")
            self.slots[entry.name] = slot

    # ------------------------------------------------------------------ what front ends read
    @property
    def names(self) -> list[str]:
        return list(self.slots)

    def slot(self, name: str) -> Slot:
        try:
            return self.slots[name]
        except KeyError:
            raise ConfigError(f"unknown model {name!r}; this fleet serves: {', '.join(self.slots)}",
                              field="model") from None

    def members(self) -> dict[str, Any]:
        """One engine client per model, by name (:class:`~omni_core.engine.fleet_member.FleetMember`)."""
        from omni_core.engine.fleet_member import FleetMember

        return {name: FleetMember(self, name) for name in self.slots}

    def measure_unknown(self) -> None:
        """Load once each model whose size its files do not tell (a built-in model has none), measure it and move
        it to host memory (or unload it): the budget then counts what it truly holds, and one too big alone is
        refused now, at start."""
        budget = self.residency.device_budget
        for slot in self.slots.values():
            if budget is None or slot.weight_bytes or slot.measured:
                continue
            try:
                with self.lease(slot.name):
                    pass
            except ResidencyError as exc:
                raise ConfigError(str(exc), field="device_budget") from None
            if not slot.entry.pinned:
                self.evict(slot.name)

    def load_pinned(self) -> None:
        """Bring every pinned model onto the device now (they are never evicted; a server starts with them)."""
        for slot in self.slots.values():
            if slot.entry.pinned:
                with self.lease(slot.name):
                    pass

    def states(self) -> list[dict[str, Any]]:
        """Each model: its state, bytes (measured or estimated), working memory, pinned, leases, last use."""
        with self._lock:
            for s in self.slots.values():
                self._note_death(s)
            return [{"name": s.name, "state": s.state, "weight_bytes": s.weight_bytes, "measured": s.measured,
                     "working_bytes": s.working_bytes, "pinned": s.entry.pinned, "leases": s.leases,
                     "loads": s.loads, "restores": s.restores, "dead_reason": s.dead_reason}
                    for s in self.slots.values()]

    def device_bytes(self) -> int:
        """What the models on the device charge now (those leaving it included, and those loading once the room
        they were given is free): never above the budget."""
        with self._lock:
            return sum(s.charge for s in self.slots.values() if s.state in ON_DEVICE and not s.reserved)

    def measured_bytes(self) -> dict[str, int]:
        """Each running engine's pipeline bytes, measured in its model process now (a released model holds 0)."""
        with self._lock:
            engines = {s.name: s.engine for s in self.slots.values() if s.engine is not None and s.state != "dead"}
        held = {}
        for name, engine in engines.items():
            try:
                held[name] = sum(engine.collective_rpc("memory_held", timeout=60))
            except Exception:  # noqa: BLE001 - it died or closed meanwhile: it holds nothing
                held[name] = 0
        return held

    # ------------------------------------------------------------------ leases
    @contextlib.contextmanager
    def lease(self, name: str) -> Iterator[Any]:
        """The model's engine, on the device and held there until the block ends (admit requests inside it)."""
        slot = self.slot(name)
        engine = self._acquire(slot)
        try:
            yield engine
        finally:
            with self._lock:
                slot.leases -= 1
                slot.last_used = time.monotonic()
                self._lock.notify_all()

    def _acquire(self, slot: Slot) -> Any:
        deadline = time.monotonic() + (self.residency.wait_timeout_s if self.residency.contention == "wait" else 0)
        while True:
            idle = self._idle_now(slot)
            with self._lock:
                if self._closed:
                    raise EngineDeadError(f"model {slot.name!r}: the server is shutting down")
                self._note_death(slot)
                if slot.state == "dead" and self.residency.restart == "never":
                    raise EngineDeadError(f"model {slot.name!r}: {slot.dead_reason}")
                if slot.state == "device" and slot.drained_for is None:
                    slot.leases += 1
                    slot.uses += 1
                    slot.last_used = time.monotonic()
                    return slot.engine
                if slot.state not in ("cold", "host", "dead"):  # moving, or draining for a waiting model
                    self._lock.wait(0.1)
                    continue
                victims, holders = self._room_for(slot, idle)
                if victims is None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        self._stop_draining_for(slot)
                        raise contention_error(slot, holders, self.residency)
                    self._drain_for(slot)
                    self._lock.wait(min(left, 0.2))
                    continue
                source = slot.state
                self._stop_draining_for(slot)  # room is made: what drained for it serves again (or is a victim)
                for v in victims:
                    v.state = "evicting"
                slot.state, slot.reserved = "loading", True
            if self._bring_in(slot, source, victims):
                with self._lock:
                    slot.leases += 1
                    slot.uses += 1
                    slot.last_used = time.monotonic()
                    return slot.engine

    def _note_death(self, slot: Slot) -> None:
        if slot.state in ("device", "host") and slot.engine is not None and slot.engine.is_dead:
            slot.state, slot.dead_reason = "dead", slot.engine.dead_reason
            logger.error("model %r: %s", slot.name, slot.dead_reason)

    def _idle_now(self, slot: Slot) -> dict[str, int]:
        """The models that could make room for ``slot`` and whose engines track no request now, each with its
        lease count (``uses``) at the time: asked of each engine outside the lock (an engine answers between two
        steps, which may take a while), and trusted under the lock only if no lease was taken since."""
        with self._lock:
            if slot.state == "device" or self.residency.device_budget is None:
                return {}
            probe = [(s, s.uses) for s in self.slots.values()
                     if s is not slot and s.state == "device" and not s.entry.pinned and s.leases == 0]
        return {s.name: uses for s, uses in probe if is_idle(s.engine)}

    def _room_for(self, slot: Slot, idle: dict[str, int]) -> tuple[list[Slot] | None, list[str]]:
        """Idle models to evict, least recently used first, so ``slot`` fits (None: busy models hold the budget,
        named in the second value). ``idle``: :meth:`_idle_now`, valid for a model no lease reached since."""
        budget = self.residency.device_budget
        resident = [s for s in self.slots.values() if s.state in ON_DEVICE and s is not slot]
        used = sum(s.charge for s in resident)
        if budget is None or used + slot.charge <= budget:
            return [], []
        victims: list[Slot] = []
        for s in sorted(resident, key=lambda s: s.last_used):
            if s.state == "device" and not s.entry.pinned and s.leases == 0 and idle.get(s.name) == s.uses:
                victims.append(s)
                used -= s.charge
                if used + slot.charge <= budget:
                    return victims, []
        return None, [s.name for s in resident if s not in victims]

    def _drain_for(self, slot: Slot) -> None:
        """Busy models hold the budget and ``slot`` waits: stop new leases on the least recently used unpinned
        ones that would make room, so they drain and the waiting model gets in (rather than waiting as long as
        their clients keep them busy). Pinned models are never drained."""
        budget = self.residency.device_budget
        resident = [s for s in self.slots.values() if s.state in ON_DEVICE and s is not slot]
        excess = sum(s.charge for s in resident) + slot.charge - budget
        excess -= sum(s.charge for s in resident if s.drained_for is not None)
        for s in sorted(resident, key=lambda s: s.last_used):
            if excess <= 0:
                return
            if s.state == "device" and s.drained_for is None and not s.entry.pinned:
                s.drained_for = slot.name
                excess -= s.charge
                logger.info("model %r drains for %r (the device budget is full)", s.name, slot.name)

    def _stop_draining_for(self, slot: Slot) -> None:
        for s in self.slots.values():
            if s.drained_for == slot.name:
                s.drained_for = None
        self._lock.notify_all()

    # ------------------------------------------------------------------ moving models
    def _bring_in(self, slot: Slot, source: str, victims: list[Slot]) -> bool:
        """Evict ``victims``, then load or restore ``slot`` (the states were set under the lock). False
        when its measured size no longer fits beside the busy models: it went to host memory, and the caller waits
        for room as for any model whose size is known."""
        try:
            for v in victims:
                self._evict(v)
            with self._lock:
                slot.reserved = False  # its room is free now: it holds what it loads
            if source == "host":
                slot.engine.resume_memory()
                slot.restores += 1
            else:
                if slot.engine is not None:  # dead: its processes are gone; close what is left of it
                    close_quietly(slot.engine)
                    slot.engine = None
                slot.engine = self._start(slot.plan)
                slot.loads += 1
            held = sum(slot.engine.collective_rpc("memory_held", timeout=120))
        except BaseException as exc:
            with self._lock:
                slot.reserved = False
                slot.state = "dead" if slot.engine is not None and slot.engine.is_dead else "cold"
                if slot.state == "cold" and slot.engine is not None:
                    close_quietly(slot.engine)
                    slot.engine = None
                slot.dead_reason = f"{type(exc).__name__}: {exc}"
                self._lock.notify_all()
            raise
        fits = True
        with self._lock:
            slot.weight_bytes, slot.measured = held, True
            budget = self.residency.device_budget
            if budget is not None and slot.charge > budget:  # measured for the first time, and too big alone
                slot.state = "cold"
                self._lock.notify_all()
                engine, slot.engine = slot.engine, None
            else:
                others = sum(s.charge for s in self.slots.values() if s.state in ON_DEVICE and s is not slot)
                fits = budget is None or others + slot.charge <= budget
                slot.dead_reason = None
                if fits:
                    slot.state = "device"
                    self._lock.notify_all()
                    return True
        if not fits:  # larger than its files said: out of the way until there is room for what it measured
            logger.info("model %r measured %d bytes, more than estimated; waiting for room", slot.name, held)
            self._evict(slot)
            return False
        close_quietly(engine)
        raise ResidencyError(too_big(slot, budget, "its pipeline, measured"), model=slot.name)

    def _evict(self, victim: Slot) -> None:
        """Move an idle model off the device: to host copies when the host budget allows, else unload it."""
        host_budget = self.residency.host_budget
        with self._lock:
            in_host = [s for s in self.slots.values() if s.state == "host"]
            keep = host_budget is None or victim.weight_bytes <= host_budget
            unload: list[Slot] = []
            if keep and host_budget is not None:
                held = sum(s.weight_bytes for s in in_host)
                for s in sorted(in_host, key=lambda s: s.last_used):
                    if held + victim.weight_bytes <= host_budget:
                        break
                    s.state = "unloading"
                    unload.append(s)
                    held -= s.weight_bytes
        for s in unload:
            self._unload(s)
        try:
            if keep:
                victim.engine.release_memory(in_flight="finish")
                state = "host"
            else:
                self._unload(victim)
                return
        except Exception as exc:  # noqa: BLE001 - it died: its memory is gone with its processes
            logger.warning("evicting model %r failed: %s", victim.name, exc)
            state = "dead" if victim.engine.is_dead else "device"
            victim.dead_reason = str(exc) if state == "dead" else None
        with self._lock:
            victim.state, victim.drained_for = state, None
            self._lock.notify_all()

    def _unload(self, slot: Slot) -> None:
        engine, slot.engine = slot.engine, None
        if engine is not None:
            close_quietly(engine)
        with self._lock:
            slot.state, slot.drained_for = "cold", None
            self._lock.notify_all()

    def evict(self, name: str) -> bool:
        """Move an idle model off the device now (``release_memory`` of its member); False if not there."""
        slot = self.slot(name)
        with self._lock:
            if slot.state != "device" or slot.leases:
                return False
            slot.state = "evicting"
        self._evict(slot)
        return True

    def close(self) -> None:
        """Close every model's engine (aborting what they still run); safe to call twice."""
        with self._lock:
            self._closed = True
            engines = [s.engine for s in self.slots.values() if s.engine is not None]
            for s in self.slots.values():
                s.engine, s.state = None, "cold"
            self._lock.notify_all()
        for engine in engines:
            close_quietly(engine)


__all__ = ["ON_DEVICE", "STATES", "ModelFleet", "Slot"]

"""The fault matrix: what Omni promises when a process dies or memory runs out, one cell per (layout, fault, load).

The table here is the one the tests run (``tests/faults/test_fault_matrix.py`` runs every cell whose ``test`` is
``core``: the server's own death on a real ``omni serve``, the other faults on the same app over an engine in the
test's process; the Ray executor plugin's tests run the ``ray`` cells) and the one docs/faults.md shows
(:func:`render_table`, written by ``scripts/doc_tables.py``; a test fails when the doc is stale). A cell's promise
is stated once, per fault, with the bound its test checks.
"""

from __future__ import annotations

import attrs

#: every answer a cell waits for must come within this many seconds of the fault (a loaded 2-core machine included)
ANSWER_WITHIN_S = 15.0
#: every process of a killed server (workers, stage processes, fork server, resource tracker) exits within this
GONE_WITHIN_S = 20.0
#: concurrent clients of a cell "under load"
LOAD_CLIENTS = 16
#: the memory of a server that survived a fault may exceed its level before by this much (allocator slack)
MEMORY_SLACK_BYTES = 96 << 20

#: what each layout is (how ``omni serve`` is started for it)
LAYOUTS = {
    "uni": "the model in the server's process (`--executor uni`)",
    "mp": "one model worker process (`--executor mp`)",
    "mp-cfg2": "two model worker processes, CFG-parallel (`--executor mp`, `--parallel-config` with `cfg_parallel_size` 2)",
    "stages": "a model worker, an encode and a decode process (`--executor mp --encode-workers 1 --decode-workers 1`)",
    "ray": "Ray actors on a local two-node cluster (`executor=\"ray\"`, Ulysses-2 / data-parallel 2)",
}

_DEAD = ("every in-flight request is answered 503 `engine_dead` naming the {what} within {t:g} s; a later request "
         "too; `/health` says 503 `dead` with the reason and `omni_engine_dead` is 1 (`omni serve` then exits with "
         "code 3, for its supervisor to restart it: `tests/serve/test_cli_serve.py`); once closed, no process, "
         "shared-memory segment or port is left")
#: what the design promises, per fault
PROMISES = {
    "kill-worker": _DEAD.format(what="worker and its exit code", t=ANSWER_WITHIN_S),
    "kill-encode": _DEAD.format(what="encode stage", t=ANSWER_WITHIN_S),
    "kill-decode": _DEAD.format(what="decode stage", t=ANSWER_WITHIN_S),
    "kill-server": (f"every in-flight client gets a connection error within {ANSWER_WITHIN_S:g} s (none hangs); every "
                    f"process below the server exits within {GONE_WITHIN_S:g} s (the death signal and the creator "
                    f"sentinel); no shared-memory segment is left; the port is free"),
    "oom-request": (f"the request that ran out of memory is answered 500 `out_of_memory` within {ANSWER_WITHIN_S:g} s; "
                    f"the others of its wave complete; `/health` says `degraded` (200) and `omni_engine_degraded` "
                    f"is 1 until a request completes, then `ok`; the out-of-memory counter counts it; no request is "
                    f"left in the engine and its memory is back to its level before"),
    "oom-rank": ("as `oom-request`, the error naming the rank that ran out of memory; both ranks fail that request "
                 "together and serve the next"),
    "kill-actor": ("every in-flight request fails with the engine-dead error naming the rank and its node within "
                   "10 s; a later request raises `EngineDeadError`; `close()` leaves no actor or placement group"),
}


@attrs.frozen
class FaultCell:
    layout: str = attrs.field(validator=attrs.validators.in_(LAYOUTS))
    fault: str = attrs.field(validator=attrs.validators.in_(PROMISES))
    #: "idle" (the fault strikes with nothing in flight) or "load" (:data:`LOAD_CLIENTS` clients in flight)
    load: str = attrs.field(validator=attrs.validators.in_(("idle", "load")))
    #: where the cell runs: "core" (``tests/faults/test_fault_matrix.py``) or a plugin's test
    test: str = "core"

    @property
    def id(self) -> str:
        return f"{self.layout}-{self.fault}-{self.load}"

    @property
    def promise(self) -> str:
        return PROMISES[self.fault]


_RAY_TEST = "plugins/executors/ray/tests/test_ray_executor.py::test_killed_actor_fails_every_caller_within_10s"
CELLS: tuple[FaultCell, ...] = tuple(
    [FaultCell(layout, "kill-server", load) for layout in ("uni", "mp", "stages") for load in ("idle", "load")]
    + [FaultCell("mp", "kill-worker", load) for load in ("idle", "load")]
    + [FaultCell("stages", f"kill-{stage}", load) for stage in ("encode", "decode") for load in ("idle", "load")]
    + [FaultCell(layout, "oom-request", load) for layout in ("uni", "mp") for load in ("idle", "load")]
    + [FaultCell("mp-cfg2", "oom-rank", load) for load in ("idle", "load")]
    + [FaultCell("ray", "kill-actor", load, test=_RAY_TEST) for load in ("idle", "load")]
)


def core_cells() -> list[FaultCell]:
    return [c for c in CELLS if c.test == "core"]


def render_table() -> str:
    """The docs' table: a row per cell, then what each fault's promise is."""
    lines = ["| layout | fault | load | tested in |", "|---|---|---|---|"]
    for c in CELLS:
        where = "`tests/faults/test_fault_matrix.py`" if c.test == "core" else f"`{c.test}`"
        lines.append(f"| {c.layout} | {c.fault} | {c.load} | {where} |")
    lines += ["", "| fault | what the design promises (each cell checks exactly this) |", "|---|---|"]
    for fault in dict.fromkeys(c.fault for c in CELLS):
        lines.append(f"| {fault} | {PROMISES[fault]} |")
    lines += ["", "| layout | what it is |", "|---|---|"]
    lines += [f"| {name} | {text} |" for name, text in LAYOUTS.items()]
    return "\n".join(lines) + "\n"


__all__ = ["ANSWER_WITHIN_S", "CELLS", "FaultCell", "GONE_WITHIN_S", "LAYOUTS", "LOAD_CLIENTS", "MEMORY_SLACK_BYTES",
           "PROMISES", "core_cells", "render_table"]

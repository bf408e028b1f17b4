"""Process groups of the parallel strategies: the rank layout and the per-process group registry.

Ranks are laid out ``tp-sp-pp-cfg-dp`` (the first name varies fastest), as in vllm-omni / xDiT; inside the
sequence-parallel (sp = ulysses x ring) dimension Ulysses is the inner one, so a Ulysses group is a run of
consecutive ranks (the ones that talk the most sit closest) and a Ring group strides over them.

A worker calls :func:`init_parallel_state` once, right after ``torch.distributed.init_process_group``.
Before that (and in a single-process run) every accessor returns a trivial group of size 1, so model code
that calls ``get_sp_group()`` runs unchanged without any distributed setup.

This module does not import torch at import time (:class:`RankLayout` is plain Python).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import attrs

from omni_core.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from omni_core.config import ParallelConfig
    from omni_core.distributed.group_coordinator import GroupCoordinator

DIMS = ("tp", "sp", "pp", "cfg", "dp")
DEFAULT_ORDER = "tp-sp-pp-cfg-dp"
#: every group name the registry knows; ``ulysses`` and ``ring`` are the two factors of ``sp``
GROUP_NAMES = ("world", "tp", "sp", "ulysses", "ring", "pp", "cfg", "dp")


def _parse_order(order: str) -> tuple[str, ...]:
    names = tuple(order.split("-"))
    if sorted(names) != sorted(DIMS):
        raise ConfigError(f"rank order {order!r} is invalid: it must name each of {', '.join(DIMS)} once, "
                          f"joined by '-' (e.g. {DEFAULT_ORDER!r})", field="order")
    return names


def _positive(instance, attribute, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"RankLayout.{attribute.name}={value!r} is invalid: expected an integer >= 1",
                          field=attribute.name)


@attrs.frozen
class RankLayout:
    """Which global ranks form each group, for degrees ``tp, sp, pp, cfg, dp`` (pure Python).

    ``rank = i_0 + n_0 * (i_1 + n_1 * (i_2 + ...))`` over the dimensions in ``order``; the ``sp`` index is
    itself ``u + ulysses * r`` (Ulysses inner, Ring outer). A group of kind ``k`` is the set of ranks whose
    indices agree on every dimension except ``k``; groups are listed in increasing order of their ranks.
    """

    tp: int = attrs.field(default=1, validator=_positive)
    sp: int = attrs.field(default=1, validator=_positive)
    pp: int = attrs.field(default=1, validator=_positive)
    cfg: int = attrs.field(default=1, validator=_positive)
    dp: int = attrs.field(default=1, validator=_positive)
    order: str = DEFAULT_ORDER
    #: Ulysses degree inside sp (None = all of sp); ``ring = sp // ulysses``
    ulysses: int | None = None

    def __attrs_post_init__(self) -> None:
        _parse_order(self.order)
        if self.ulysses is not None:
            _positive(self, attrs.fields(RankLayout).ulysses, self.ulysses)
            if self.sp % self.ulysses:
                raise ConfigError(f"RankLayout.ulysses={self.ulysses} must divide sp={self.sp}", field="ulysses")

    @classmethod
    def from_config(cls, parallel_config: ParallelConfig) -> RankLayout:
        pc = parallel_config
        return cls(tp=pc.tensor_parallel_size, sp=pc.sequence_parallel_size, pp=pc.pipeline_parallel_size,
                   cfg=pc.cfg_parallel_size, dp=pc.data_parallel_size, ulysses=pc.ulysses_degree)

    # ------------------------------------------------------------------ sizes and coordinates
    @property
    def ulysses_degree(self) -> int:
        return self.sp if self.ulysses is None else self.ulysses

    @property
    def ring_degree(self) -> int:
        return self.sp // self.ulysses_degree

    @property
    def world_size(self) -> int:
        return math.prod(self.size(d) for d in DIMS)

    def size(self, name: str) -> int:
        """Degree of a dimension or sub-dimension (``ulysses``, ``ring``, ``world`` too)."""
        if name == "world":
            return self.world_size
        if name == "ulysses":
            return self.ulysses_degree
        if name == "ring":
            return self.ring_degree
        if name not in DIMS:
            raise KeyError(f"unknown group {name!r}; known: {', '.join(GROUP_NAMES)}")
        return getattr(self, name)

    def coords(self, rank: int) -> dict[str, int]:
        """Index of ``rank`` along every dimension, plus its ``ulysses`` and ``ring`` index inside sp."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of size {self.world_size}")
        out: dict[str, int] = {}
        rest = rank
        for name in _parse_order(self.order):
            out[name] = rest % self.size(name)
            rest //= self.size(name)
        out["ulysses"] = out["sp"] % self.ulysses_degree
        out["ring"] = out["sp"] // self.ulysses_degree
        return out

    def rank_of(self, **coords: int) -> int:
        """Inverse of :meth:`coords` (missing dimensions count as 0; ``ulysses``/``ring`` may replace ``sp``)."""
        c = dict(coords)
        if "ulysses" in c or "ring" in c:
            c["sp"] = c.pop("ulysses", 0) + self.ulysses_degree * c.pop("ring", 0)
        rank, stride = 0, 1
        for name in _parse_order(self.order):
            i = c.pop(name, 0)
            if not 0 <= i < self.size(name):
                raise ValueError(f"{name} index {i} is outside 0..{self.size(name) - 1}")
            rank += i * stride
            stride *= self.size(name)
        if c:
            raise KeyError(f"unknown dimension(s) {sorted(c)}")
        return rank

    # ------------------------------------------------------------------ groups
    def groups(self, name: str) -> list[list[int]]:
        """All groups of one kind, each a sorted list of global ranks (a partition of the world)."""
        if name == "world":
            return [list(range(self.world_size))]
        self.size(name)  # validates the name
        seen: dict[tuple, list[int]] = {}
        for rank in range(self.world_size):
            c = self.coords(rank)
            if name == "ulysses":
                key = tuple(c[d] for d in DIMS if d != "sp") + (c["ring"],)
            elif name == "ring":
                key = tuple(c[d] for d in DIMS if d != "sp") + (c["ulysses"],)
            else:
                key = tuple(c[d] for d in DIMS if d != name)
            seen.setdefault(key, []).append(rank)
        return sorted(seen.values())

    def group_of(self, name: str, rank: int) -> list[int]:
        """The group of kind ``name`` that contains ``rank``."""
        for ranks in self.groups(name):
            if rank in ranks:
                return ranks
        raise ValueError(f"rank {rank} is outside the world of size {self.world_size}")

    def replicas(self) -> list[list[int]]:
        """Ranks of each data-parallel replica (index = dp index): they run the same requests together."""
        out: dict[int, list[int]] = {}
        for rank in range(self.world_size):
            out.setdefault(self.coords(rank)["dp"], []).append(rank)
        return [out[i] for i in sorted(out)]

    def describe(self) -> str:
        return (f"RankLayout(world={self.world_size}, tp={self.tp}, sp={self.sp} (ulysses {self.ulysses_degree} x "
                f"ring {self.ring_degree}), pp={self.pp}, cfg={self.cfg}, dp={self.dp}, order={self.order})")


def validate_parallel_config(parallel_config: Any, world_size: int | None = None, num_heads: int | None = None, *,
                             num_kv_heads: int | None = None, supported: tuple[str, ...] | list[str] | None = None,
                             model: str = "the model") -> ParallelConfig:
    """Check a parallel config (a ``ParallelConfig`` or a dict) against the world size, the denoiser's head
    count and a pipeline's ``supported_parallel``; raise ``ConfigError`` with the field and the fix."""
    from omni_core.config import ParallelConfig

    pc = ParallelConfig.coerce(parallel_config)
    return pc.check(world_size, num_heads=num_heads, num_kv_heads=num_kv_heads, supported=supported, model=model)


# ---------------------------------------------------------------------- per-process registry
@attrs.define
class _State:
    config: Any
    layout: RankLayout
    rank: int
    groups: dict[str, GroupCoordinator]
    #: process groups this module created (destroyed by destroy_parallel_state)
    owned: list[Any]
    #: the backend the groups were created with (None: the world group's)
    backend: str | None = None


_STATE: _State | None = None
_TRIVIAL: dict[str, GroupCoordinator] = {}


def is_initialized() -> bool:
    return _STATE is not None


def init_parallel_state(parallel_config: Any = None, rank: int | None = None, world_size: int | None = None, *,
                        backend: str | None = None) -> RankLayout:
    """Create every process group of ``parallel_config`` for this process and register the accessors.

    Call once per worker after ``torch.distributed.init_process_group`` (not needed for a single process:
    with world size 1 and no process group everything stays trivial). Every rank creates every group in
    the same order, as ``dist.new_group`` requires. ``backend`` defaults to the world group's.
    """
    global _STATE
    from omni_core.config import ParallelConfig

    pc = ParallelConfig.coerce(parallel_config)
    if _STATE is not None:
        raise RuntimeError("parallel state is already initialised; call destroy_parallel_state() first")
    import torch.distributed as dist

    from omni_core.distributed.group_coordinator import GroupCoordinator

    dist_ready = dist.is_available() and dist.is_initialized()
    if dist_ready:
        if rank is not None and rank != dist.get_rank():
            raise ValueError(f"init_parallel_state(rank={rank}) but torch.distributed says rank {dist.get_rank()}")
        if world_size is not None and world_size != dist.get_world_size():
            raise ValueError(f"init_parallel_state(world_size={world_size}) but torch.distributed has "
                             f"{dist.get_world_size()} processes")
        rank, world_size = dist.get_rank(), dist.get_world_size()
    else:
        rank = 0 if rank is None else rank
        world_size = 1 if world_size is None else world_size
        if world_size > 1:
            raise RuntimeError(f"init_parallel_state for {world_size} processes needs torch.distributed to be "
                               f"initialised first (torch.distributed.init_process_group)")
    pc.check(world_size)
    layout = RankLayout.from_config(pc)
    pgs, owned = _create_groups(layout, rank, world_size, backend)
    groups = {name: GroupCoordinator(layout.group_of(name, rank), rank, pg, name=name) for name, pg in pgs.items()}
    _STATE = _State(pc, layout, rank, groups, owned, backend)
    return layout


def _create_groups(layout: RankLayout, rank: int, world_size: int, backend: str | None) -> tuple[dict, list]:
    """({group name: this rank's process group (None for a group of one)}, the groups created here)."""
    import torch.distributed as dist

    pgs: dict[str, Any] = {}
    owned: list[Any] = []
    by_ranks: dict[tuple[int, ...], Any] = {}
    for name in GROUP_NAMES:
        for ranks in layout.groups(name):
            key = tuple(ranks)
            if len(ranks) == 1:
                pg = None
            elif len(ranks) == world_size:
                pg = dist.group.WORLD
            elif key in by_ranks:  # e.g. sp and ulysses when ring_degree == 1
                pg = by_ranks[key]
            else:  # every rank calls new_group for every group, in the same order
                pg = by_ranks[key] = dist.new_group(ranks, backend=backend)
                owned.append(pg)
            if rank in ranks:
                pgs[name] = pg
    return pgs, owned


def drop_parallel_groups() -> None:
    """Forget every process group of the parallel state (the coordinators stay, with no group) after they
    were aborted, so nothing here keeps them alive (``omni_core.distributed.recovery``)."""
    if _STATE is None:
        return
    for g in _STATE.groups.values():
        g.group = None
    _STATE.owned = []


def rebuild_parallel_state() -> None:
    """Create the parallel state's process groups again, as :func:`init_parallel_state` did, on the default
    group now in place (a rebuilt one: ``omni_core.distributed.recovery``), and give them to the same
    ``GroupCoordinator`` objects, so model code that holds a coordinator goes on with the new groups. Every
    rank calls it, in the same order as every other collective set-up."""
    if _STATE is None:
        return
    import torch.distributed as dist

    pgs, owned = _create_groups(_STATE.layout, _STATE.rank, dist.get_world_size(), _STATE.backend)
    for name, pg in pgs.items():
        _STATE.groups[name].group = pg
    _STATE.owned = owned


def destroy_parallel_state() -> None:
    """Drop the registry and destroy the process groups it created (the world group stays to its owner)."""
    global _STATE
    state, _STATE = _STATE, None
    if state is None:
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        for pg in state.owned:
            try:
                dist.destroy_process_group(pg)
            except Exception:  # noqa: BLE001 - best effort on shutdown
                pass


def _get(name: str) -> GroupCoordinator:
    if _STATE is not None:
        return _STATE.groups[name]
    group = _TRIVIAL.get(name)
    if group is None:
        from omni_core.distributed.group_coordinator import GroupCoordinator

        group = _TRIVIAL[name] = GroupCoordinator([0], 0, None, name=name)
    return group


def get_world_group() -> GroupCoordinator:
    return _get("world")


def get_tp_group() -> GroupCoordinator:
    return _get("tp")


def get_sp_group() -> GroupCoordinator:
    """Sequence-parallel group (ulysses x ring): the ranks that share one denoiser forward's tokens."""
    return _get("sp")


def get_ulysses_group() -> GroupCoordinator:
    return _get("ulysses")


def get_ring_group() -> GroupCoordinator:
    return _get("ring")


def get_pp_group() -> GroupCoordinator:
    return _get("pp")


def get_cfg_group() -> GroupCoordinator:
    """CFG-parallel group: rank 0 runs the positive branch, rank 1 the negative one."""
    return _get("cfg")


def get_dp_group() -> GroupCoordinator:
    """Data-parallel group: one rank from each replica. Replicas take different requests (the executor
    decides which); nothing in a denoiser forward communicates over this group."""
    return _get("dp")


def get_group(name: str) -> GroupCoordinator:
    if name not in GROUP_NAMES:
        raise KeyError(f"unknown group {name!r}; known: {', '.join(GROUP_NAMES)}")
    return _get(name)


def get_rank_layout() -> RankLayout:
    """The layout in use (a single-process layout when not initialised)."""
    return _STATE.layout if _STATE is not None else RankLayout()


def get_parallel_config() -> Any:
    if _STATE is not None:
        return _STATE.config
    from omni_core.config import ParallelConfig

    return ParallelConfig()


def communication_stats() -> dict[str, int]:
    """Bytes this process has sent, per group name and ``"total"`` (see ``GroupCoordinator.bytes_sent``)."""
    groups = _STATE.groups if _STATE is not None else _TRIVIAL
    out = {name: g.bytes_sent for name, g in groups.items()}
    out["total"] = sum(out.values())
    return out


def reset_communication_stats() -> None:
    for g in (_STATE.groups if _STATE is not None else _TRIVIAL).values():
        g.reset_stats()

"""A sequence-parallel region: where a denoiser's tokens are sharded over the sp group.

Inside a region every ``Attention`` layer runs through a sequence-parallel strategy (Ulysses, Ring or
both); outside it nothing changes. The region remembers the global token count so that it can pad to a
multiple of the sp size when sharding, tell the strategy which keys are padding, and strip the padding when
gathering. Joint attention (text + image tokens in one sequence, as in MMDiT / Qwen-Image) keeps the text
tokens whole on every rank: the region carries their count and on which side of the sequence they sit.

Models normally get a region from a :class:`~omni_core.attention.parallel.plan.SequenceParallelPlan`; code
that shards by hand uses :func:`sequence_parallel_region`.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import attrs
import torch

from omni_core.attention.parallel.strategies import build_sequence_parallel_attention
from omni_core.distributed.group_coordinator import GroupCoordinator
from omni_core.forward_context import forward_context, use_forward_context

SIDES = ("front", "back")


@attrs.define(eq=False)
class SPRegion:
    """State of one sharded forward: groups, global token count, joint-text layout."""

    sp_group: GroupCoordinator
    ulysses_group: GroupCoordinator
    ring_group: GroupCoordinator
    #: global (unpadded) number of sharded tokens; set by the first :meth:`shard`
    seq_len: int | None = None
    #: replicated text tokens that joint attention puts next to the sharded tokens (0: none)
    joint_text_len: int = 0
    #: where the text tokens sit in a joint sequence: "front" (Qwen-Image, Flux) or "back" (SD3)
    joint_text_side: str = attrs.field(default="front")
    #: False once the tokens were gathered (attention after that point runs locally)
    active: bool = True
    gathered: bool = False
    #: one-shot hooks that already ran in this forward (``shard_before``)
    fired: set = attrs.field(factory=set)
    #: who opened the region (a plan's hooks use it to ignore regions that are not theirs)
    owner: Any = None

    @joint_text_side.validator
    def _side(self, attribute, value):
        if value not in SIDES:
            raise ValueError(f"joint_text_side={value!r} is invalid; allowed: {', '.join(SIDES)}")

    def __attrs_post_init__(self) -> None:
        u, r, sp = self.ulysses_group, self.ring_group, self.sp_group
        if u.world_size * r.world_size != sp.world_size or (
                sp.rank_in_group != u.rank_in_group + u.world_size * r.rank_in_group):
            raise ValueError(f"inconsistent sequence-parallel groups: sp {sp.ranks} must be ulysses {u.ranks} "
                             f"(inner) x ring {r.ranks} (outer)")

    @classmethod
    def from_parallel_state(cls, **fields: Any) -> SPRegion:
        from omni_core.distributed.parallel_state import get_ring_group, get_sp_group, get_ulysses_group

        return cls(get_sp_group(), get_ulysses_group(), get_ring_group(), **fields)

    # ------------------------------------------------------------------ sizes
    @property
    def degree(self) -> int:
        return self.sp_group.world_size

    @property
    def padded_len(self) -> int:
        return -(-self._len() // self.degree) * self.degree

    @property
    def shard_len(self) -> int:
        """Tokens each rank holds (padding included)."""
        return self.padded_len // self.degree

    @property
    def is_sharding(self) -> bool:
        """Whether attention must run sequence-parallel right now."""
        return self.active and self.seq_len is not None and self.degree > 1

    def _len(self) -> int:
        if self.seq_len is None:
            raise RuntimeError("the sequence-parallel region has not sharded anything yet")
        return self.seq_len

    # ------------------------------------------------------------------ data movement
    def shard(self, x: torch.Tensor, dim: int = 1, name: str = "tensor") -> torch.Tensor:
        """This rank's slice of ``x`` along ``dim`` (the token dimension), zero-padded to a multiple of the
        sp size. The first call fixes the region's token count; later ones must match it."""
        dim %= x.dim()
        n = x.shape[dim]
        if self.seq_len is None:
            self.seq_len = n
        elif n != self.seq_len:
            raise ValueError(f"sequence parallel: {name} has {n} tokens along dim {dim} but the region shards "
                             f"{self.seq_len} tokens; every sharded input must cover the same tokens")
        if self.degree == 1:
            return x
        pad = self.padded_len - n
        if pad:
            shape = list(x.shape)
            shape[dim] = pad
            x = torch.cat([x, x.new_zeros(shape)], dim=dim)
        return x.narrow(dim, self.sp_group.rank_in_group * self.shard_len, self.shard_len)

    def gather(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Inverse of :meth:`shard`: all-gather the shards along ``dim`` and strip the padding."""
        if self.degree == 1:
            return x
        dim %= x.dim()
        if x.shape[dim] != self.shard_len:
            raise ValueError(f"sequence parallel gather: expected {self.shard_len} tokens along dim {dim}, "
                             f"got {x.shape[dim]} (shape {tuple(x.shape)})")
        return self.sp_group.all_gather(x, dim).narrow(dim, 0, self._len())

    def end(self) -> None:
        """Leave the sharded part: attention after this point runs locally on gathered tokens."""
        self.active = False
        self.gathered = True


def current_region() -> SPRegion | None:
    """The region of the forward in progress, or None outside one."""
    return getattr(forward_context().attn_strategy, "region", None)


def set_joint_text(text_len: int, side: str | None = None) -> None:
    """Tell the current region how many replicated text tokens joint attention adds (for models whose
    text length is only known inside the forward). No-op outside a region."""
    region = current_region()
    if region is not None:
        region.joint_text_len = int(text_len)
        if side is not None:
            region._side(None, side)
            region.joint_text_side = side


@contextlib.contextmanager
def sequence_parallel_region(*, joint_text_len: int = 0, joint_text_side: str = "front",
                             region: SPRegion | None = None) -> Iterator[SPRegion]:
    """Open a region over the current sp group (``get_sp_group()``): ``Attention`` layers called inside run
    sequence-parallel once ``region.shard(...)`` has fixed the token count. With an sp group of one rank the
    region is trivial (shard/gather return their input) and no strategy is installed."""
    region = region or SPRegion.from_parallel_state(joint_text_len=joint_text_len, joint_text_side=joint_text_side)
    if region.degree == 1:
        yield region
        return
    with use_forward_context(attn_strategy=build_sequence_parallel_attention(region)):
        yield region

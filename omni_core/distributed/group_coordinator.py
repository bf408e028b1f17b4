"""``GroupCoordinator``: one process group plus the collectives the parallel strategies need.

Device-agnostic: it calls ``torch.distributed`` with whatever device the tensors are on (gloo on CPU,
nccl/hccl on accelerators). A group of size 1 never touches ``torch.distributed``, so single-process code
uses the same calls at no cost.

Every collective adds to ``bytes_sent`` the payload this rank sends to others in the usual algorithm
(all-to-all: the (n-1)/n of the input that leaves; all-gather: its piece to n-1 peers; ring exchange:
the tensor; all-reduce: 2(n-1)/n of it). The benchmark reports these counters.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Sequence

import torch
import torch.distributed as dist


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class RingHandle:
    """Pending ring exchange: ``wait()`` returns the tensor received from the previous rank."""

    def __init__(self, works: list, received: torch.Tensor, sent: torch.Tensor | None = None) -> None:
        # the sent tensor stays referenced until the exchange completes
        self._works, self._received, self._sent = works, received, sent

    def wait(self) -> torch.Tensor:
        for w in self._works:
            w.wait()
        self._works, self._sent = [], None
        return self._received


class GroupCoordinator:
    """A group of global ``ranks`` seen from global rank ``rank``; ``group`` is the torch ProcessGroup
    (None for a group of one)."""

    def __init__(self, ranks: Sequence[int], rank: int, group: Any = None, *, name: str = "") -> None:
        self.ranks = list(ranks)
        if rank not in self.ranks:
            raise ValueError(f"rank {rank} is not in group {name or ''} {self.ranks}")
        self.rank = rank
        self.rank_in_group = self.ranks.index(rank)
        self.world_size = len(self.ranks)
        self.group = group
        self.name = name
        if self.world_size > 1 and group is None:
            raise ValueError(f"group {name!r} of {self.world_size} ranks needs a torch ProcessGroup")
        self.bytes_sent = 0
        self.op_bytes: dict[str, int] = defaultdict(int)
        self.op_calls: dict[str, int] = defaultdict(int)

    def __repr__(self) -> str:
        return (f"GroupCoordinator({self.name!r}, ranks={self.ranks}, rank_in_group={self.rank_in_group})")

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def next_rank(self) -> int:
        """Global rank after this one in the ring."""
        return self.ranks[(self.rank_in_group + 1) % self.world_size]

    @property
    def prev_rank(self) -> int:
        return self.ranks[(self.rank_in_group - 1) % self.world_size]

    def _count(self, op: str, nbytes: int) -> None:
        self.bytes_sent += int(nbytes)
        self.op_bytes[op] += int(nbytes)
        self.op_calls[op] += 1

    def reset_stats(self) -> None:
        self.bytes_sent = 0
        self.op_bytes.clear()
        self.op_calls.clear()

    # ------------------------------------------------------------------ collectives
    def all_to_all(self, x: torch.Tensor, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        """Split ``x`` into ``world_size`` equal chunks along ``scatter_dim``, send chunk ``i`` to rank ``i``,
        and concatenate what arrives along ``gather_dim`` in rank order."""
        n = self.world_size
        if n == 1:
            return x
        scatter_dim %= x.dim()
        gather_dim %= x.dim()
        if x.shape[scatter_dim] % n:
            raise ValueError(f"all_to_all over {n} ranks: dim {scatter_dim} of shape {tuple(x.shape)} does not "
                             f"divide by {n}")
        send = torch.stack(x.tensor_split(n, dim=scatter_dim), 0).contiguous()
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        self._count("all_to_all", _nbytes(send) * (n - 1) // n)
        return torch.cat(recv.unbind(0), dim=gather_dim)

    def all_gather(self, x: torch.Tensor, dim: int = 0, sizes: Sequence[int] | None = None) -> torch.Tensor:
        """Concatenate every rank's ``x`` along ``dim`` in rank order. With ``sizes`` (each rank's length
        along ``dim``, known to all) the pieces may differ in length; see :meth:`all_gather_uneven`."""
        n = self.world_size
        if n == 1:
            return x
        dim %= x.dim()
        x = x.contiguous()
        if sizes is None or len(set(sizes)) == 1:
            parts = [torch.empty_like(x) for _ in range(n)]
            dist.all_gather(parts, x, group=self.group)
            self._count("all_gather", _nbytes(x) * (n - 1))
            return torch.cat(parts, dim=dim)
        sizes = list(sizes)
        if len(sizes) != n or sizes[self.rank_in_group] != x.shape[dim]:
            raise ValueError(f"all_gather sizes {sizes} do not match the group ({n} ranks) or this rank's "
                             f"length {x.shape[dim]}")
        longest = max(sizes)
        if x.shape[dim] < longest:
            pad_shape = list(x.shape)
            pad_shape[dim] = longest - x.shape[dim]
            x = torch.cat([x, x.new_zeros(pad_shape)], dim=dim)
        parts = [torch.empty_like(x) for _ in range(n)]
        dist.all_gather(parts, x, group=self.group)
        self._count("all_gather", _nbytes(x) * (n - 1))
        return torch.cat([p.narrow(dim, 0, s) for p, s in zip(parts, sizes)], dim=dim)

    def all_gather_uneven(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """:meth:`all_gather` when lengths along ``dim`` differ and are not known to every rank (one extra
        small collective exchanges them)."""
        if self.world_size == 1:
            return x
        mine = torch.tensor([x.shape[dim % x.dim()]], dtype=torch.int64, device=x.device)
        sizes = self.all_gather(mine, 0).tolist()
        return self.all_gather(x, dim, sizes=sizes)

    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In-place all-reduce (``op``: sum, max, min, avg); returns ``x``."""
        n = self.world_size
        if n == 1:
            return x
        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        if op == "avg":
            dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.group)
            x.div_(n)
        else:
            dist.all_reduce(x, op=ops[op], group=self.group)
        self._count("all_reduce", 2 * _nbytes(x) * (n - 1) // n)
        return x

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """In-place broadcast from group rank ``src``; returns ``x``."""
        n = self.world_size
        if n == 1:
            return x
        dist.broadcast(x, src=self.ranks[src], group=self.group)
        if self.rank_in_group == src:
            self._count("broadcast", _nbytes(x) * (n - 1))
        return x

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self.ranks[src], group=self.group)
        return box[0]

    def send(self, x: torch.Tensor, dst: int) -> None:
        """Send to group rank ``dst``."""
        dist.send(x.contiguous(), dst=self.ranks[dst], group=self.group)
        self._count("send", _nbytes(x))

    def recv(self, like: torch.Tensor, src: int) -> torch.Tensor:
        """Receive a tensor shaped like ``like`` from group rank ``src``."""
        out = torch.empty_like(like)
        dist.recv(out, src=self.ranks[src], group=self.group)
        return out

    def ring_exchange(self, x: torch.Tensor) -> RingHandle:
        """Start sending ``x`` to the next rank of the ring and receiving the previous rank's tensor of the
        same shape; overlap compute, then ``handle.wait()`` returns the received tensor."""
        if self.world_size == 1:
            return RingHandle([], x)
        x = x.contiguous()
        recv = torch.empty_like(x)
        ops = [dist.P2POp(dist.isend, x, self.next_rank, self.group),
               dist.P2POp(dist.irecv, recv, self.prev_rank, self.group)]
        works = dist.batch_isend_irecv(ops)
        self._count("ring", _nbytes(x))
        return RingHandle(works, recv, x)

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)

"""CFG parallel: the positive and negative guidance branches on two ranks instead of one after the other.

Rank 0 of the cfg group evaluates the positive branch, rank 1 the negative one; an all-gather gives every
rank both, and every rank combines them the same way, so the latents stay identical on all ranks without a
broadcast. Without a cfg group (size 1) the branches run one after the other on this rank, so a pipeline
calls the same function in every configuration.

Data parallel needs no helper in the forward: replicas (``get_dp_group()``) run different requests and
never communicate inside a step; which requests a replica takes is the executor's business
(``RankLayout.replicas()`` lists the ranks of each replica).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from omni_core.distributed.group_coordinator import GroupCoordinator
from omni_core.distributed.parallel_state import get_cfg_group

Branch = Callable[[], torch.Tensor]


def parallel_branches(fns: Sequence[Branch], group: GroupCoordinator | None = None) -> list[torch.Tensor]:
    """Evaluate ``fns`` (zero-argument callables returning same-shaped tensors) spread round-robin over the
    group (branch ``i`` on group rank ``i % n``) and return all results on every rank, in order."""
    group = group or get_cfg_group()
    n, me = group.world_size, group.rank_in_group
    if n == 1:
        return [fn() for fn in fns]
    mine = [fns[i]() for i in range(me, len(fns), n)]
    per_rank = -(-len(fns) // n)
    if not mine:
        raise ValueError(f"{len(fns)} branch(es) cannot be spread over a cfg group of {n} ranks "
                         f"(every rank needs at least one)")
    while len(mine) < per_rank:  # equal shapes for the all-gather; the filler is dropped below
        mine.append(torch.zeros_like(mine[0]))
    gathered = group.all_gather(torch.stack(mine).unsqueeze(0), dim=0)  # [n, per_rank, ...]
    return [gathered[i % n, i // n] for i in range(len(fns))]


def cfg_parallel_predict(fn_pos: Branch, fn_neg: Branch | None,
                         group: GroupCoordinator | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(positive, negative)`` predictions on every rank; the branches run on cfg ranks 0 and 1 when the
    cfg group has two ranks. ``fn_neg=None`` (guidance off for this call) runs only the positive branch."""
    if fn_neg is None:
        return fn_pos(), None
    group = group or get_cfg_group()
    if group.world_size > 2:
        raise ValueError(f"cfg_parallel_predict needs a cfg group of 1 or 2 ranks, got {group.world_size}; "
                         f"use parallel_branches for more branches")
    pos, neg = parallel_branches([fn_pos, fn_neg], group)
    return pos, neg


def cfg_combine(pos: torch.Tensor, neg: torch.Tensor, scale: float, normalize: bool = False) -> torch.Tensor:
    """``neg + scale * (pos - neg)``; with ``normalize`` rescaled to the positive branch's norm over the last
    dimension (Qwen-Image's true CFG)."""
    out = neg + scale * (pos - neg)
    if normalize:
        out = out * (torch.linalg.vector_norm(pos, dim=-1, keepdim=True)
                     / torch.linalg.vector_norm(out, dim=-1, keepdim=True))
    return out


def cfg_parallel_guidance(fn_pos: Branch, fn_neg: Branch | None, scale: float, *, normalize: bool = False,
                          group: GroupCoordinator | None = None) -> torch.Tensor:
    """The guided prediction: both branches (in parallel when a cfg group exists) then :func:`cfg_combine`."""
    pos, neg = cfg_parallel_predict(fn_pos, fn_neg, group)
    return pos if neg is None else cfg_combine(pos, neg, scale, normalize)

"""Sequence-parallel attention: Ulysses, Ring and Ulysses x Ring strategies over any attention backend,
sharded regions, and the plans through which a model opts in.

Importing this package does not import torch; the names below load on first access.
"""

from __future__ import annotations

from omni_core.utils.lazy import lazy_dir, lazy_exports

_LAZY = {
    "SequenceParallelAttention": "omni_core.attention.parallel.strategies:SequenceParallelAttention",
    "UlyssesAttention": "omni_core.attention.parallel.strategies:UlyssesAttention",
    "RingAttention": "omni_core.attention.parallel.strategies:RingAttention",
    "USPAttention": "omni_core.attention.parallel.strategies:USPAttention",
    "build_sequence_parallel_attention": "omni_core.attention.parallel.strategies:build_sequence_parallel_attention",
    "attention_with_lse": "omni_core.attention.parallel.strategies:attention_with_lse",
    "merge_partials": "omni_core.attention.parallel.strategies:merge_partials",
    "SPRegion": "omni_core.attention.parallel.region:SPRegion",
    "sequence_parallel_region": "omni_core.attention.parallel.region:sequence_parallel_region",
    "current_region": "omni_core.attention.parallel.region:current_region",
    "set_joint_text": "omni_core.attention.parallel.region:set_joint_text",
    "SequenceParallelPlan": "omni_core.attention.parallel.plan:SequenceParallelPlan",
    "SequenceParallelHandle": "omni_core.attention.parallel.plan:SequenceParallelHandle",
    "apply_sequence_parallel": "omni_core.attention.parallel.plan:apply_sequence_parallel",
    "apply_sequence_parallel_to_pipeline": "omni_core.attention.parallel.plan:apply_sequence_parallel_to_pipeline",
}

__all__ = sorted(_LAZY)
__getattr__ = lazy_exports(__name__, _LAZY)
__dir__ = lazy_dir(__name__, _LAZY)

"""Single-process tests: rank layout, config validation, trivial groups, plans, log-sum-exp merging."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from omni_core.config import ParallelConfig
from omni_core.distributed import RankLayout, validate_parallel_config
from omni_core.errors import ConfigError


# ---------------------------------------------------------------------- RankLayout (pure python)
def test_layout_usp_times_cfg_hand_computed():
    # 8 ranks: sp = ulysses 2 x ring 2, cfg 2 -> rank = u + 2*r + 4*cfg
    lay = RankLayout(sp=4, cfg=2, ulysses=2)
    assert lay.world_size == 8 and lay.ring_degree == 2
    assert lay.groups("sp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert lay.groups("ulysses") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lay.groups("ring") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lay.groups("cfg") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lay.groups("dp") == [[r] for r in range(8)]
    assert lay.groups("tp") == [[r] for r in range(8)]
    assert lay.groups("world") == [list(range(8))]
    assert lay.coords(6) == {"tp": 0, "sp": 2, "pp": 0, "cfg": 1, "dp": 0, "ulysses": 0, "ring": 1}
    assert lay.rank_of(ulysses=1, ring=1, cfg=1) == 7
    assert lay.replicas() == [list(range(8))]


def test_layout_all_dims_hand_computed():
    # tp 2 (fastest), sp 2, cfg 2, dp 2 -> rank = tp + 2*sp + 4*cfg + 8*dp
    lay = RankLayout(tp=2, sp=2, cfg=2, dp=2)
    assert lay.world_size == 16
    assert lay.groups("tp")[:3] == [[0, 1], [2, 3], [4, 5]]
    assert lay.groups("sp")[:3] == [[0, 2], [1, 3], [4, 6]]
    assert lay.groups("cfg")[:3] == [[0, 4], [1, 5], [2, 6]]
    assert lay.groups("dp")[:3] == [[0, 8], [1, 9], [2, 10]]
    assert lay.replicas() == [list(range(8)), list(range(8, 16))]
    assert lay.group_of("cfg", 13) == [9, 13]
    # sp is all-ulysses by default
    assert lay.groups("ulysses") == lay.groups("sp") and lay.groups("ring") == [[r] for r in range(16)]


def test_layout_groups_partition_the_world_and_match_coords():
    lay = RankLayout(tp=1, sp=6, pp=1, cfg=2, dp=3, ulysses=3)
    for name in ("tp", "sp", "ulysses", "ring", "pp", "cfg", "dp"):
        groups = lay.groups(name)
        assert sorted(r for g in groups for r in g) == list(range(lay.world_size))
        assert all(len(g) == lay.size(name) for g in groups)
    for rank in range(lay.world_size):
        assert lay.rank_of(**{k: v for k, v in lay.coords(rank).items() if k != "sp"}) == rank


def test_layout_other_order_and_errors():
    lay = RankLayout(sp=2, dp=2, order="dp-sp-tp-pp-cfg")  # dp fastest
    assert lay.groups("dp") == [[0, 1], [2, 3]] and lay.groups("sp") == [[0, 2], [1, 3]]
    with pytest.raises(ConfigError, match="rank order"):
        RankLayout(order="tp-sp-pp-cfg")
    with pytest.raises(ConfigError, match="ulysses=3 must divide sp=4"):
        RankLayout(sp=4, ulysses=3)
    with pytest.raises(ConfigError, match="cfg"):
        RankLayout(cfg=0)


def test_layout_from_config():
    lay = RankLayout.from_config(ParallelConfig(ulysses_degree=2, ring_degree=3, cfg_parallel_size=2))
    assert (lay.sp, lay.ulysses_degree, lay.ring_degree, lay.cfg, lay.world_size) == (6, 2, 3, 2, 12)


# ---------------------------------------------------------------------- validation
def test_validate_world_size_and_heads():
    assert validate_parallel_config({"ulysses_degree": 2, "cfg_parallel_size": 2}, 4, num_heads=8).world_size == 4
    with pytest.raises(ConfigError, match=r"ulysses 2 x ring 2 = 4 process\(es\) but the world size is 2") as e:
        validate_parallel_config({"ulysses_degree": 2, "ring_degree": 2}, world_size=2)
    assert e.value.field == "parallel_config"
    with pytest.raises(ConfigError, match=r"must divide 12 \(allowed: 1, 2, 3, 4, 6, 12\)") as e:
        validate_parallel_config(ParallelConfig(ulysses_degree=8), num_heads=12)
    assert e.value.field == "ulysses_degree"
    with pytest.raises(ConfigError, match="key/value heads"):
        validate_parallel_config({"ulysses_degree": 4}, num_heads=8, num_kv_heads=2)
    with pytest.raises(ConfigError, match="WanPipeline does not support cfg parallelism") as e:
        validate_parallel_config({"cfg_parallel_size": 2}, supported=("ulysses",), model="WanPipeline")
    assert e.value.field == "cfg_parallel_size"
    with pytest.raises(ConfigError, match="did you mean 'ulysses_degree'"):
        validate_parallel_config({"ulyses_degree": 2})


def test_importing_does_not_import_torch():
    code = ("import sys, omni_core.distributed, omni_core.attention.parallel\n"
            "from omni_core.distributed import RankLayout, validate_parallel_config\n"
            "RankLayout(sp=2).groups('sp'); assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# ---------------------------------------------------------------------- single process: everything trivial
def test_trivial_groups_without_init():
    import torch

    from omni_core.distributed import (communication_stats, get_cfg_group, get_dp_group, get_ring_group,
                                       get_sp_group, get_ulysses_group, get_world_group, is_initialized)

    assert not is_initialized()
    x = torch.randn(2, 6, 4)
    for g in (get_sp_group(), get_ulysses_group(), get_ring_group(), get_cfg_group(), get_dp_group(),
              get_world_group()):
        assert (g.world_size, g.rank_in_group, g.ranks) == (1, 0, [0])
        assert g.all_to_all(x, 1, 2) is x and g.all_gather(x, 1) is x and g.broadcast(x) is x
        assert g.ring_exchange(x).wait() is x
    assert communication_stats()["total"] == 0


def test_init_single_process_without_torch_distributed():
    from omni_core.distributed import destroy_parallel_state, get_sp_group, init_parallel_state, is_initialized

    with pytest.raises(RuntimeError, match="init_process_group"):
        init_parallel_state(ParallelConfig(ulysses_degree=2), rank=0, world_size=2)
    with pytest.raises(ConfigError, match="world size is 1"):
        init_parallel_state(ParallelConfig(ulysses_degree=2))
    layout = init_parallel_state(ParallelConfig())
    try:
        assert is_initialized() and layout.world_size == 1 and get_sp_group().world_size == 1
    finally:
        destroy_parallel_state()
    assert not is_initialized()


def test_cfg_parallel_helpers_serial():
    import torch

    from omni_core.distributed import cfg_combine, cfg_parallel_guidance, cfg_parallel_predict

    pos, neg = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
    calls = []
    p, n = cfg_parallel_predict(lambda: calls.append("p") or pos, lambda: calls.append("n") or neg)
    assert calls == ["p", "n"] and p is pos and n is neg
    assert cfg_parallel_predict(lambda: pos, None) == (pos, None)
    assert torch.allclose(cfg_combine(pos, neg, 3.0), neg + 3.0 * (pos - neg))
    g = cfg_parallel_guidance(lambda: pos, lambda: neg, 3.0, normalize=True)
    assert torch.allclose(g.norm(dim=-1), pos.norm(dim=-1), atol=1e-5)


# ---------------------------------------------------------------------- log-sum-exp merging
def test_lse_merge_equals_full_attention():
    import torch

    from omni_core.attention import Attention
    from omni_core.attention.parallel import attention_with_lse, merge_partials

    layer = Attention(4, 8, num_kv_heads=2)
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 9, 4, 8, generator=g), torch.randn(2, 20, 2, 8, generator=g), torch.randn(
        2, 20, 2, 8, generator=g)
    mask = torch.ones(2, 20, dtype=torch.bool)
    mask[0, 3:7] = False  # per-sample mask -> plain torch path
    mask[:, 15:] = False  # shared by the batch -> keys dropped, backend path
    ref = layer.impl.forward(q, k, v, mask)
    acc = None
    for sl in (slice(0, 5), slice(5, 12), slice(12, 17), slice(17, 20)):  # the last block is all masked
        acc = merge_partials(acc, attention_with_lse(layer.impl, q, k[:, sl], v[:, sl], mask[:, sl]))
    assert torch.allclose(acc[0], ref, atol=1e-5)
    assert attention_with_lse(layer.impl, q, k[:, 17:], v[:, 17:], mask[:, 17:]) is None
    full = layer.impl.forward_with_lse(q, k[:, :15], v[:, :15])[1]
    assert torch.allclose(acc[1][1], full[1], atol=1e-5) and not math.isinf(acc[1].max())


# ---------------------------------------------------------------------- plans
def test_plan_coercion_and_errors():
    from torch import nn

    from omni_core.attention.parallel import SequenceParallelPlan, apply_sequence_parallel

    plan = SequenceParallelPlan.coerce({"shard_after": "x_embedder", "gather_before": "final_layer",
                                        "gather": None, "joint_text": "encoder_hidden_states"})
    assert plan.shard_outputs == {"x_embedder": 1} and plan.gather_before == {"final_layer": 1}
    assert plan.gather_output is None and plan.joint_text_input == "encoder_hidden_states"
    with pytest.raises(ConfigError, match="did you mean 'shard_inputs'"):
        SequenceParallelPlan.coerce({"shard_input": {"x": 1}})

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(2, 2)

        def forward(self, hidden_states):
            return self.proj(hidden_states)

    with pytest.raises(ConfigError, match="declares no _sp_plan"):
        apply_sequence_parallel(M())
    with pytest.raises(ConfigError, match="did you mean 'hidden_states'"):
        apply_sequence_parallel(M(), {"shard": {"hidden_state": 1}})
    with pytest.raises(ConfigError, match="submodule 'final'"):
        apply_sequence_parallel(M(), {"shard": {"hidden_states": 1}, "gather_before": "final"})

    class Blocks(nn.Module):  # shard_before with ``*``: one hook per matching block, argument names checked on each
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([M(), M()])

        def forward(self, hidden_states):
            return self.blocks[1](self.blocks[0](hidden_states))

    handle = apply_sequence_parallel(Blocks(), {"shard_before": {"blocks.*": {"hidden_states": 1}}})
    assert len(handle._hooks) == 2 + 2  # enter/exit + one per block (not per Linear below them)
    with pytest.raises(ConfigError, match="did you mean 'hidden_states'"):
        apply_sequence_parallel(Blocks(), {"shard_before": {"blocks.*": {"hidden_state": 1}}})
    with pytest.raises(ConfigError, match=r"submodule 'layers\.\*'"):
        apply_sequence_parallel(Blocks(), {"shard_before": {"layers.*": {"hidden_states": 1}}})


@pytest.fixture(scope="module")
def tiny():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("omni_tests_tiny_dit_local", Path(__file__).with_name("tiny_dit.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_plan_is_a_no_op_on_one_process(tiny):
    import torch

    from omni_core.attention.parallel import apply_sequence_parallel
    from omni_core.forward_context import forward_context

    model = tiny.build(tiny.TinyDiT, seed=0)
    x = torch.randn(1, 4, 6, 10)
    txt, mask = tiny.text_inputs(1, 5)
    with torch.inference_mode():
        before = model(x, txt, mask)
        seen = []
        model.blocks[0].register_forward_pre_hook(lambda m, a: seen.append(forward_context().attn_strategy))
        handle = apply_sequence_parallel(model)
        after = model(x, txt, mask)
    assert torch.equal(before, after) and seen == [None]
    assert apply_sequence_parallel(model) is not handle  # re-applying replaces the hooks
    model._sp_handle.remove()
    assert not hasattr(model, "_sp_handle")


def test_worker_checks_the_parallel_config_against_every_declared_denoiser():
    """Head counts for Ulysses come from the specs (one process: nothing is installed, the check still runs)."""
    from types import SimpleNamespace

    from torch import nn

    from omni_core.attention.parallel import apply_sequence_parallel_to_pipeline
    from omni_core.config import ParallelConfig
    from omni_core.pipelines.denoiser import DenoiserSpec

    class Block(nn.Module):
        def forward(self, hidden_states):
            return hidden_states

    class Pipe:
        supported_parallel = ("ulysses",)

        def denoisers(self):
            module = nn.Module()
            module.blocks = nn.ModuleList([Block()])
            return [DenoiserSpec(name=n, module=module, blocks_attr="blocks", block_params="hidden_states",
                                 carried="hidden_states", block_outputs="hidden_states",
                                 residual_stream="hidden_states", num_heads=h,
                                 sp_plan={"shard": {"hidden_states": 1}}) for n, h in (("a", 4), ("b", 6))]

    ok = SimpleNamespace(parallel_config=ParallelConfig.from_kwargs(ulysses_degree=2))
    assert apply_sequence_parallel_to_pipeline(Pipe(), ok) == []  # sp group of one rank: nothing to install
    bad = SimpleNamespace(parallel_config=ParallelConfig.from_kwargs(ulysses_degree=4))
    with pytest.raises(ConfigError, match=r"ulysses_degree=4 is invalid: Ulysses splits the 6 attention heads of "
                                          r"Pipe \(b\)") as e:
        apply_sequence_parallel_to_pipeline(Pipe(), bad)
    assert e.value.field == "ulysses_degree"

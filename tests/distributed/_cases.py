"""Checks that run inside spawned worker processes (see test_parallel_dist.py).

Every case is computed twice on each rank: first on one process (before ``init_parallel_state``), then with
the parallel config active; the worker returns ``(config, case, max_abs_diff)`` rows for the parent to check.
"""

from __future__ import annotations

import importlib.util
import sys
import zlib
from pathlib import Path

import torch

from omni_core.attention import Attention
from omni_core.attention.parallel import apply_sequence_parallel, current_region, sequence_parallel_region
from omni_core.attention.parallel.strategies import _join, _split
from omni_core.config import ParallelConfig
from omni_core.forward_context import forward_context
from omni_core.distributed import (RankLayout, cfg_parallel_guidance, communication_stats, destroy_parallel_state,
                                   get_cfg_group, init_parallel_state, reset_communication_stats)


def load_tiny():
    name = "omni_tests_tiny_dit"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("tiny_dit.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


# ---------------------------------------------------------------------- attention-layer cases
# (name, seq_len, heads, kv_heads, text_len, text_side, text_mask, token_mask, role)
ATTN_CASES = [
    ("self S=37", 37, 8, 8, 0, "front", False, False, "self"),
    ("self S=32", 32, 8, 8, 0, "front", False, False, "self"),
    ("self S=3 (< ranks)", 3, 8, 8, 0, "front", False, False, "self"),
    ("gqa S=37", 37, 8, 4, 0, "front", False, False, "self"),
    ("joint front T=7 text mask S=37", 37, 8, 8, 7, "front", True, False, "joint"),
    ("joint back T=5 S=30", 30, 8, 8, 5, "back", False, False, "joint"),
    ("self token mask S=37", 37, 8, 8, 0, "front", False, True, "self"),
    ("cross S=37 text mask", 37, 8, 8, 9, "front", True, False, "cross"),
    # queries whole on every rank (text_len of them) over the sharded keys: LTX-2's audio attending to its video
    ("replicated queries L=9 over S=37", 37, 8, 4, 9, "front", False, False, "replicated"),
    ("replicated queries L=5 over S=30 token mask", 30, 8, 8, 5, "front", False, True, "replicated"),
]


def attention_case(case, parallel: bool) -> torch.Tensor:
    name, seq, heads, kv_heads, text, side, text_mask, token_mask, role = case
    batch, head_dim = 2, 16
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    layer = Attention(heads, head_dim, num_kv_heads=kv_heads, role=role, replicated_queries=role == "replicated")

    def rnd(n, h):
        return torch.randn(batch, n, h, head_dim, generator=g)

    q_img, k_img, v_img = rnd(seq, heads), rnd(seq, kv_heads), rnd(seq, kv_heads)
    tm = torch.ones(batch, text, dtype=torch.bool)
    if text_mask:
        tm[0, text - 2:] = False
    im = torch.rand(batch, seq, generator=g) > 0.3 if token_mask else torch.ones(batch, seq, dtype=torch.bool)
    if role == "cross":  # queries are the sharded tokens, keys/values the (replicated) text
        kt, vt = rnd(text, kv_heads), rnd(text, kv_heads)
        if not parallel:
            return layer(q_img, kt, vt, tm)
        with sequence_parallel_region() as region:
            out = layer(region.shard(q_img), kt, vt, tm)
            return region.gather(out)
    if role == "replicated":
        q = rnd(text, heads)
        if not parallel:
            return layer(q, k_img, v_img, im if token_mask else None)
        with sequence_parallel_region() as region:
            return layer(q, region.shard(k_img), region.shard(v_img), region.shard(im) if token_mask else None)
    q_txt, k_txt, v_txt = (rnd(text, heads), rnd(text, kv_heads), rnd(text, kv_heads)) if text else (None,) * 3
    use_mask = text_mask or token_mask
    if not parallel:
        mask = _join(tm if text else None, im, side) if use_mask else None
        return layer(_join(q_txt, q_img, side), _join(k_txt, k_img, side), _join(v_txt, v_img, side), mask)
    with sequence_parallel_region(joint_text_len=text, joint_text_side=side) as region:
        q, k, v = (_join(t, region.shard(x), side) for t, x in ((q_txt, q_img), (k_txt, k_img), (v_txt, v_img)))
        mask = _join(tm if text else None, region.shard(im), side) if use_mask else None
        out_txt, out_img = _split(layer(q, k, v, mask), text, side)
        return _join(out_txt, region.gather(out_img), side)


# ---------------------------------------------------------------------- model cases
def _models():
    tiny = load_tiny()
    dit = tiny.build(tiny.TinyDiT, seed=0, heads=4)
    tok = tiny.build(tiny.TinyTokenModel, seed=1)
    wan = tiny.build(tiny.TinyWanLike, seed=2)
    for model in (dit, tok, wan):
        apply_sequence_parallel(model)
    return tiny, dit, tok, wan


def model_cases(dp_index: int):
    """(name, fn) pairs; ``dp_index`` picks the request a data-parallel replica serves."""
    tiny, dit, tok, wan = _models()
    txt, tmask = tiny.text_inputs(2, 6)
    neg, nmask = tiny.text_inputs(2, 6, seed=7)

    def latents(h, w, seed):
        return torch.randn(2, 4, h, w, generator=torch.Generator().manual_seed(seed))

    t = torch.tensor([0.3, 0.7])
    cases = [
        ("TinyDiT 10x14 (S=35)", lambda: dit(latents(10, 14, 3), txt, tmask, t)),
        ("TinyDiT 8x8 (S=16)", lambda: dit(latents(8, 8, 4), encoder_hidden_states=txt, timestep=t)),
    ]
    g = torch.Generator().manual_seed(5)
    hs = torch.randn(2, 37, 8, generator=g)
    cos, sin = tiny.rope_tables(torch.arange(37) * 0.5, 8)
    cases.append(("TinyTokenModel S=37", lambda: tok(hs, txt, cos, sin, encoder_mask=tmask)[0]))
    cases.append(("TinyWanLike 6x14 (S=21)", lambda: wan(latents(6, 14, 12), txt)))
    x = latents(10, 14, 11)
    cases.append(("CFG guidance (TinyDiT)", lambda: cfg_parallel_guidance(
        lambda: dit(x, txt, tmask, t), lambda: dit(x, neg, nmask, t), 4.0, normalize=True)))
    y = latents(6, 10, 100 + dp_index)  # each replica serves a different request
    cases.append((f"DP replica {dp_index} request", lambda: dit(y, txt, tmask, t)))
    return cases


class _Boom(torch.nn.Module):
    _sp_plan = {"shard": {"hidden_states": 1}}

    def forward(self, hidden_states):
        self.inside = current_region()
        raise RuntimeError("boom")


def failing_forward_leaves_no_region() -> float:
    """0.0 when a forward that raises inside a sharded region leaves the forward context as it was."""
    from omni_core.distributed import get_sp_group

    model = _Boom()
    apply_sequence_parallel(model)
    try:
        model(torch.zeros(1, 5, 2))
    except RuntimeError:
        pass
    opened = (model.inside is not None) == (get_sp_group().world_size > 1)
    return 0.0 if opened and current_region() is None and forward_context().attn_strategy is None else 1.0


def worker(rank: int, world_size: int, configs: list[dict]) -> list[tuple[str, str, float]]:
    rows = []
    with torch.inference_mode():
        for cfg in configs:
            pc = ParallelConfig.from_kwargs(**cfg)
            dp_index = RankLayout.from_config(pc).coords(rank)["dp"]
            cases = [(c[0], lambda c=c, p=False: attention_case(c, p)) for c in ATTN_CASES]
            refs = [fn() for _, fn in cases]
            mcases = model_cases(dp_index)
            refs += [fn() for _, fn in mcases]
            init_parallel_state(pc)
            try:
                outs = [attention_case(c, True) for c in ATTN_CASES]
                model_bytes = []
                for _, fn in mcases:
                    reset_communication_stats()
                    outs.append(fn())
                    model_bytes.append(communication_stats()["total"])
                restored = failing_forward_leaves_no_region()
                if pc.cfg_parallel_size > 1:
                    assert get_cfg_group().world_size == 2
            finally:
                destroy_parallel_state()
            label = ", ".join(f"{k}={v}" for k, v in cfg.items())
            for (name, _), ref, out in zip(cases + mcases, refs, outs):
                assert out.shape == ref.shape, (label, name, out.shape, ref.shape)
                rows.append((label, name, float((out - ref).abs().max())))
            rows.append((label, "forward context restored after a failing forward", restored))
            rows += [(label, f"bytes sent by {name}", n) for (name, _), n in zip(mcases, model_bytes)]
    return rows


# ---------------------------------------------------------------------- plans declared in denoiser specs
class _SpecPipeline:
    """A pipeline as the worker sees one after ``load``: it only declares its denoiser (no hooks of its own)."""

    supported_parallel = ("ulysses", "ring")

    def __init__(self, model: torch.nn.Module, plan: dict) -> None:
        self.model, self.plan = model, plan

    def denoisers(self):
        from omni_core.pipelines.denoiser import DenoiserSpec

        return [DenoiserSpec(name="transformer", module=self.model, blocks_attr="blocks",
                             block_params=("hidden_states", "encoder_hidden_states", "rotary_emb"),
                             carried="hidden_states", block_outputs="hidden_states", residual_stream="hidden_states",
                             num_heads=4, sp_plan=self.plan)]


def spec_worker(rank: int, world_size: int, configs: list[dict]) -> list[tuple[str, str, float]]:
    """``apply_sequence_parallel_to_pipeline`` after ``init_parallel_state`` installs the plan a spec declares
    (the module has no ``_sp_plan`` attribute): same output as one process, and tokens really travel."""
    from types import SimpleNamespace

    from omni_core.attention.parallel import apply_sequence_parallel_to_pipeline

    tiny = load_tiny()
    rows = []
    with torch.inference_mode():
        for cfg in configs:
            model = tiny.build(tiny.TinyWanLike, seed=2)
            plan = type(model)._sp_plan
            model._sp_plan = None  # only the spec declares it
            txt, _ = tiny.text_inputs(2, 6)
            x = torch.randn(2, 4, 6, 14, generator=torch.Generator().manual_seed(12))
            ref = model(x, txt)
            pc = ParallelConfig.from_kwargs(**cfg)
            init_parallel_state(pc)
            try:
                names = apply_sequence_parallel_to_pipeline(_SpecPipeline(model, plan), SimpleNamespace(parallel_config=pc))
                reset_communication_stats()
                out = model(x, txt)
                sent = communication_stats()["total"]
            finally:
                destroy_parallel_state()
            label = ", ".join(f"{k}={v}" for k, v in cfg.items())
            rows += [(label, "installed", float(names == ["transformer"])), (label, "max abs diff",
                                                                            float((out - ref).abs().max())),
                     (label, "bytes sent", float(sent))]
    return rows

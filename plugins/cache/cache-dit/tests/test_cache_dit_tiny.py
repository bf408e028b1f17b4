"""cache_dit on the core's tiny DiT (``omni_core.testing``'s ``tiny_dit_model``), with only this plugin installed:
the cache contract, real skipping (block-call counts), per-request decisions in request batches and step waves,
metrics, the model's shipped defaults, a config that does not fit the model, and -- with a model built here --
a two-stream denoiser with its own parameter names cached by its declaration alone. The model reaches the
backend through its ``DenoiserSpec`` only."""

from __future__ import annotations

import functools
import json
import shutil

import pytest
import torch

from omni_core.errors import ConfigError
from omni_core.testing.cache_contract import CacheBackendContract
from omni_core.testing import load_model
from omni_core.testing.driver import make_states, output_tensors

PROMPTS = ["a red square", "a blue circle on the left", "two green dots"]
#: the tiny model's requests reuse some steps at this threshold, and (at 8, 10, 12 steps) different ones
CONFIG = {"residual_diff_threshold": 0.1, "max_warmup_steps": 1}


class TestCacheDiTContract(CacheBackendContract):
    cache_backend = "cache_dit"
    cache_config = CONFIG
    off_config = {"residual_diff_threshold": 0}
    sampling = {"num_inference_steps": 8}
    metric_keys = ("cache_backend", "steps_computed", "steps_reused", "cache_branches")


@pytest.fixture
def dit(enable_cache):
    """``dit(pipeline, **config)``: a fresh enabled ``cache_dit`` backend, disabled after the test."""
    return functools.partial(enable_cache, "cache_dit")


def states(pipeline, steps=(8, 10, 12), seed=0):
    """A request per step count, prompts in turn, CFG on (empty negative prompt)."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(steps))]
    return make_states(pipeline, prompts, seed=seed, negative_prompt="", num_inference_steps=list(steps))


def cached_steps(backend, state):
    return {k: v["cached_steps"] for k, v in backend.request_metrics(state)["cache_branches"].items()}


# ---------------------------------------------------------------------------------------------- skipping
def test_skipping_really_happens_and_is_counted(tiny_dit, dit):
    """Block 1's MLP runs only on computed steps; block 0 (the Fn block, whose residual decides) always runs."""
    rows = {0: 0, 1: 0}
    hooks = [tiny_dit.transformer.blocks[i].mlp.register_forward_pre_hook(
        lambda m, a, i=i: rows.__setitem__(i, rows[i] + a[0].shape[0])) for i in (0, 1)]
    try:
        backend = dit(tiny_dit, **CONFIG)
        batch = states(tiny_dit)
        output_tensors(tiny_dit, batch, backend)
    finally:
        for h in hooks:
            h.remove()
    metrics = [backend.request_metrics(s) for s in batch]
    calls = 2 * (8 + 10 + 12)  # cond and uncond rows, one per step and request
    reused = sum(m["steps_reused"] for m in metrics)
    assert reused > 0
    assert rows[0] == calls and rows[1] == calls - reused
    for m, n in zip(metrics, (8, 10, 12)):
        assert m["cache_backend"] == "cache_dit"
        assert set(m["cache_branches"]) == {"cond/transformer", "uncond/transformer"}
        assert m["steps_computed"] + m["steps_reused"] == 2 * n
        for branch in m["cache_branches"].values():
            assert branch["computed"] + branch["reused"] == n
            assert branch["cached_steps"] and min(branch["cached_steps"]) >= 1  # warmup step 0 computes


def test_threshold_zero_runs_every_block_and_makes_no_context(tiny_dit, dit):
    from omni_cache_dit.backend import DiTState

    backend = dit(tiny_dit, residual_diff_threshold=0)
    batch = states(tiny_dit, steps=(6, 6))
    output_tensors(tiny_dit, batch, backend)
    for state in batch:
        dits = [v for v in state.cache_state.values() if isinstance(v, DiTState)]
        assert len(dits) == 2 and all(d.context is None and d.calls == 6 for d in dits)
        assert backend.request_metrics(state)["steps_reused"] == 0
    assert backend.split_calls == 0


# ---------------------------------------------------------------------------------------------- per request
def test_batches_and_step_waves_decide_per_request(tiny_dit, dit):
    """Requests of 8, 10 and 12 steps make different decisions; batched together, or joining a step wave at
    different waves, each makes exactly the decisions (and image) it makes alone, in its own contexts."""
    backend = dit(tiny_dit, **CONFIG)
    alone, alone_steps = [], []
    for i in range(3):
        state = states(tiny_dit)[i]
        alone += output_tensors(tiny_dit, [state], backend)
        alone_steps.append(cached_steps(backend, state))
    assert len({str(s) for s in alone_steps}) > 1, "the requests should make different decisions"
    for admit_at in ([0, 0, 0], [0, 2, 5]):
        batch = states(tiny_dit)
        outs = output_tensors(tiny_dit, batch, backend, admit_at)
        assert [cached_steps(backend, s) for s in batch] == alone_steps
        for a, b in zip(alone, outs):
            assert torch.equal(a, b)
        contexts = {id(v.context) for s in batch for v in s.cache_state.values() if hasattr(v, "context")}
        assert len(contexts) == 6  # (request, branch)
        assert all(s.cache_state["cond", "transformer"].context.cache_config.num_inference_steps == n
                   for s, n in zip(batch, (8, 10, 12)))
    assert backend.split_calls > 0


def test_decisions_stay_on_this_rank_when_torch_distributed_has_several(tiny_dit, dit, monkeypatch):
    """Every context holds whole rows of one (request, branch) on this rank, so its decisions are this rank's
    alone. cache-dit's cached blocks average the residual diff over the world (``dist.all_reduce``) whenever
    torch.distributed has several ranks: under cfg parallel (cond on rank 0, uncond on rank 1) each branch then
    decided on the mean of both (issue #35). Here a world of 2 whose other rank's diff is 0: no collective is
    issued, and the decisions and output are those without a world."""
    import torch.distributed as dist

    backend = dit(tiny_dit, **CONFIG)
    state = states(tiny_dit)[0]
    (want,) = output_tensors(tiny_dit, [state], backend)
    want_branches = backend.request_metrics(state)["cache_branches"]
    assert any(b["cached_steps"] for b in want_branches.values())

    reduced = []

    def all_reduce(tensor, op=None, group=None, async_op=False):
        reduced.append(op)
        tensor.mul_(0.5)  # the mean with a rank whose diff is 0

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    state = states(tiny_dit)[0]
    (got,) = output_tensors(tiny_dit, [state], backend)
    assert reduced == []
    assert backend.request_metrics(state)["cache_branches"] == want_branches
    assert torch.equal(got, want)


def test_scm_mask_and_taylorseer_are_sized_per_request(tiny_dit, dit):
    backend = dit(tiny_dit, residual_diff_threshold=0.3, max_warmup_steps=2, scm_steps_mask_policy="fast",
                  scm_steps_policy="static", enable_taylorseer=True, max_continuous_cached_steps=-1)
    batch = states(tiny_dit, steps=(10, 16))
    outs = output_tensors(tiny_dit, batch, backend)
    for state, n in zip(batch, (10, 16)):
        ctx = state.cache_state["cond", "transformer"].context
        assert ctx.calibrator is not None
        mask = ctx.cache_config.steps_computation_mask
        assert len(mask) == n
        cached = set(cached_steps(backend, state)["cond/transformer"])
        assert cached and cached <= {i for i, m in enumerate(mask) if m == 0}
    assert all(torch.isfinite(o).all() for o in outs)


# ---------------------------------------------------------------------------------------------- config vs model
def test_compute_blocks_must_fit_the_model(tiny_dit):
    from omni_cache_dit.backend import CacheDiTBackend

    with pytest.raises(ConfigError, match="Fn_compute_blocks=2 .* 2 blocks: Fn must be < 2") as err:
        CacheDiTBackend({"Fn_compute_blocks": 2}).enable(tiny_dit)
    assert err.value.field == "cache_config.Fn_compute_blocks"
    assert "forward" not in tiny_dit.transformer.__dict__


def test_compute_blocks_error_reaches_the_user_from_the_worker(tiny_dit_model):
    from omni_core import Omni
    from omni_core.errors import OmniError

    with pytest.raises(OmniError, match="Fn_compute_blocks=2 .*'transformer' denoiser"):
        Omni(tiny_dit_model, warmup=False, cache_backend="cache_dit", cache_config={"Fn_compute_blocks": 2})


def test_model_folder_ships_defaults_and_the_user_overrides_them(tiny_dit_model, tmp_path, dit):
    """``cache_defaults.json``'s ``cache_dit`` entry is the model's default config; cache_config wins key by key."""
    folder = shutil.copytree(tiny_dit_model, tmp_path / "model")
    (folder / "cache_defaults.json").write_text(json.dumps(
        {"cache_dit": {"residual_diff_threshold": 0.1, "max_warmup_steps": 3}}))
    pipeline = load_model(str(folder))
    backend = dit(pipeline, max_warmup_steps=2)
    opts = backend.denoisers["transformer"].options
    assert (opts.residual_diff_threshold, opts.max_warmup_steps) == (0.1, 2)
    (state,) = states(pipeline, steps=(8,))
    output_tensors(pipeline, [state], backend)
    assert min(cached_steps(backend, state)["cond/transformer"]) >= 2


# ---------------------------------------------------------------------------------------------- any model
class TwoStreamBlock(torch.nn.Module):
    """A block with its own names: two carried streams returned text first, a per-row side input."""

    #: read by the model's forward from its first block (a model may read its blocks while it runs)
    out_scale = 0.5

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.img = torch.nn.Linear(dim, dim)
        self.txt = torch.nn.Linear(dim, dim)
        self.mod = torch.nn.Linear(1, dim)

    def forward(self, img, txt, t):
        gate = torch.tanh(self.mod(t[:, None]))[:, None]
        img = img + gate * torch.tanh(self.img(img) + txt.mean(1, keepdim=True))
        return txt + 0.5 * torch.tanh(self.txt(txt)), img


class TwoStreamModel(torch.nn.Module):
    def __init__(self, dim: int = 8, layers: int = 3) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([TwoStreamBlock(dim) for _ in range(layers)])

    def forward(self, image, text, t):
        for layer in self.layers:
            text, image = layer(img=image, txt=text, t=t)
        return image * self.layers[0].out_scale * len(self.layers)


class TwoStreamPipeline:
    """All a cache backend needs from a pipeline: its declared denoiser."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = TwoStreamModel()

    def denoisers(self):
        from omni_core.pipelines.denoiser import DenoiserSpec

        return [DenoiserSpec(name="net", module=self.model, blocks_attr="layers", block_params=("img", "txt", "t"),
                             carried=("img", "txt"), block_outputs=("txt", "img"), residual_stream="img",
                             side_inputs=("t",), batch_args=("image", "text", "t"))]


@torch.no_grad()
def two_stream_run(pipe, groups, steps=8):
    """``steps`` calls of the model over requests ``groups`` [(state, seed)], inputs drifting slowly per step."""
    from omni_core.forward_context import use_denoise_call

    gens = {id(s): torch.Generator().manual_seed(seed) for s, seed in groups}
    base = {id(s): (torch.randn(1, 4, 8, generator=gens[id(s)]), torch.randn(1, 3, 8, generator=gens[id(s)]))
            for s, _ in groups}
    outs = []
    for step in range(steps):
        image = torch.cat([base[id(s)][0] * (1 - 0.02 * step) for s, _ in groups])
        text = torch.cat([base[id(s)][1] for s, _ in groups])
        t = torch.tensor([1.0 - step / steps] * len(groups))
        with use_denoise_call([(s, 1, "cond") for s, _ in groups], expert="net"):
            outs.append(pipe.model(image, text, t))
    return torch.stack(outs)


def two_stream_state(steps=8):
    from omni_core.config import SamplingParams
    from omni_core.pipelines import StepState
    from omni_core.request import OmniDiffusionRequest

    state = StepState(request=OmniDiffusionRequest(prompt="x", sampling_params=SamplingParams(
        num_inference_steps=steps)))
    state.num_steps = steps
    return state


def test_a_model_declared_with_its_own_names_is_cached(dit):
    """No first-party class, names unlike cache-dit's, outputs in the other order: the spec is enough."""
    from omni_cache_dit.backend import CacheDiTBackend

    pipe = TwoStreamPipeline()
    plain = two_stream_run(pipe, [(two_stream_state(), 1), (two_stream_state(), 2)])
    # the reference for computed steps: each request alone, uncached. The backend runs each request in a cache
    # context of its own, and a batch of two is not bit-equal to each alone on every CPU (4.8e-7 on AVX-512 + AMX)
    plain_alone = torch.cat([two_stream_run(pipe, [(two_stream_state(), seed)]) for seed in (1, 2)], dim=1)
    assert (plain_alone - plain).abs().max() < 1e-5
    zero = dit(pipe, residual_diff_threshold=0)
    assert torch.equal(two_stream_run(pipe, [(two_stream_state(), 1), (two_stream_state(), 2)]), plain)
    zero.disable(pipe)

    calls = []
    hook = pipe.model.layers[1].img.register_forward_pre_hook(lambda m, a: calls.append(a))
    try:
        backend = CacheDiTBackend({"residual_diff_threshold": 0.15, "max_warmup_steps": 2,
                                   "max_continuous_cached_steps": -1})
        backend.enable(pipe)
        pair = [(two_stream_state(), 1), (two_stream_state(), 2)]
        cached = two_stream_run(pipe, pair)
    finally:
        hook.remove()
    reused = [cached_steps(backend, s)["cond/net"] for s, _ in pair]
    assert all(reused) and len(calls) == 16 - sum(map(len, reused))
    for row, steps in enumerate(reused):
        for step in range(8):
            a, b = cached[step, row], plain_alone[step, row]
            if step in steps:  # block 0 computed, the other blocks' cached residuals (of both streams) re-added
                assert not torch.equal(a, b) and (a - b).abs().max() < 0.3  # outputs ~1
            else:  # a computed step: every block ran, streams in the declared order
                assert torch.equal(a, b)
    alone = torch.cat([two_stream_run(pipe, [(two_stream_state(), seed)]) for seed in (1, 2)], dim=1)
    assert torch.equal(cached, alone)
    backend.disable(pipe)
    assert torch.equal(two_stream_run(pipe, [(two_stream_state(), 1), (two_stream_state(), 2)]), plain)


def test_a_spec_with_three_carried_streams_is_refused(dit):
    from omni_core.pipelines.denoiser import DenoiserSpec

    pipe = TwoStreamPipeline()
    spec = DenoiserSpec(name="net", module=pipe.model, blocks_attr="layers", block_params=("img", "txt", "t"),
                        carried=("img", "txt", "t"), block_outputs=("txt", "img", "t"), residual_stream="img",
                        batch_args=("image",))
    pipe.denoisers = lambda: [spec]
    with pytest.raises(ConfigError, match="carry 3 streams") as err:
        dit(pipe)
    assert err.value.field == "carried"
    assert "forward" not in pipe.model.__dict__

"""Offload hooks (our model-offload ring, diffusers' group offloading). On CPU the onload and offload
devices are the same, so what is checked here is that the hooks are installed and run and the images are
unchanged; the memory saving and the side-stream prefetch are ``gpu`` tests."""

from __future__ import annotations

import pytest
import torch

from omni_core.errors import ConfigError

from .conftest import load, run_qwen


@pytest.fixture(scope="module")
def plain(qwen_plain):
    return qwen_plain[1]


@pytest.mark.parametrize("mode", ["model", "group"])
def test_offload_hooks_run_and_change_nothing(qwen_dir, plain, mode):
    pipe = load(qwen_dir, offload=mode)
    applied = pipe.omni_optimizations
    assert applied["offload"] == mode and applied["components"] == ["text_encoder", "transformer", "vae"]
    if mode == "group":
        from diffusers.hooks import HookRegistry

        assert applied["use_stream"] is False  # CPU has no streams
        assert "group_offloading" in HookRegistry.check_if_exists_or_initialize(pipe.pipe.transformer).hooks
    else:
        from omni_core.hooks import hook_names

        assert hook_names(pipe.pipe.transformer) == ["offload.model"]
    got, _ = run_qwen(pipe)
    torch.testing.assert_close(got, plain, atol=1e-6, rtol=0)


def test_model_offload_brings_components_in_turn_in_a_ring(qwen_dir):
    """``"model"``: one ring per pipeline; each component comes in as it runs (the VAE through ``decode``, which
    diffusers routes to ``_hf_hook``), so the order is text encoder -> transformer -> VAE, and the next request's
    text encoder evicts the VAE. On CPU the moves are no-ops, so which component is current is what is checked."""
    from omni_core.hooks import get_hook, hook_names
    from omni_core.optimize.model_offload import MODEL_OFFLOAD_HOOK

    pipe = load(qwen_dir, offload="model")
    order = pipe.omni_optimizations["components"]
    modules = {name: getattr(pipe.pipe, name) for name in order}
    hooks = [get_hook(m, MODEL_OFFLOAD_HOOK) for m in modules.values()]
    ring = hooks[0].ring
    assert all(h.ring is ring for h in hooks) and all(MODEL_OFFLOAD_HOOK in hook_names(m) for m in modules.values())
    seen = []
    for name, module in modules.items():
        module.register_forward_hook(lambda m, a, o, name=name: seen.append((name, ring.current is m)))
    decode = type(modules["vae"]).decode

    def spy(vae, *args, **kwargs):
        out = decode(vae, *args, **kwargs)
        seen.append(("vae.decode", ring.current is vae))
        return out
    type(modules["vae"]).decode = spy
    moves = []  # (component, where to) of every .to() call: on CPU the moves change nothing, so they are recorded
    for name, module in modules.items():
        module.to = lambda *a, _to=module.to, _name=name, **k: (moves.append((_name, str(a[0]))), _to(*a, **k))[1]
    try:
        run_qwen(pipe)
    finally:
        type(modules["vae"]).decode = decode
        for module in modules.values():
            del module.to
    names = [n for n, _ in seen if n != "vae"]  # the VAE's own forward is not what a pipeline calls
    assert all(current for _, current in seen), seen  # every component ran while current
    assert names[0] == "text_encoder" and names[-1] == "vae.decode" and "transformer" in names, names
    assert ring.current is modules["vae"]
    # each component that comes in sends the one before it home first (a ring, not three resident components):
    # in, then each next one in after the one before it went home: (text encoder in), (text encoder out, transformer
    # in), (transformer out, VAE in); without the eviction all three would stay on the device
    assert [name for name, _ in moves] == ["text_encoder", "text_encoder", "transformer", "transformer", "vae"], moves
    assert {to for _, to in moves} == {"cpu"}
    modules["text_encoder"](torch.ones(1, 3, dtype=torch.long))
    assert ring.current is modules["text_encoder"]


def test_offload_with_several_ranks_on_one_device_is_refused_before_workers():
    from omni_core.entrypoints.omni import Omni

    with pytest.raises(ConfigError, match=r"dp 2 = 2 process\(es\) on 1 cpu device") as exc:
        Omni("shapes", offload="group", parallel_config={"data_parallel_size": 2}, oversubscribe=True)
    assert exc.value.field == "offload"


@pytest.mark.gpu
def test_group_offload_with_streams_on_the_accelerator(qwen_dir):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from omni_core.config import OmniDiffusionConfig
    from omni_core.optimize.components import model_bytes
    from omni_core.pipelines import load_pipeline, resolve_model

    def loaded(**options):
        config = OmniDiffusionConfig(model=qwen_dir, dtype="float32", **options)
        return load_pipeline(resolve_model(qwen_dir), config, "cuda", torch.float32)

    ref, _ = run_qwen(loaded())
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    pipe = loaded(offload="group")
    assert pipe.omni_optimizations["use_stream"] is True
    assert torch.cuda.memory_allocated() - base < sum(model_bytes(pipe).values()) / 2  # weights wait on the host
    got, _ = run_qwen(pipe)
    torch.testing.assert_close(got.cpu(), ref.cpu(), atol=1e-5, rtol=0)

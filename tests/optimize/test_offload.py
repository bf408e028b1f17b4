"""Offload hooks (accelerate's model offload chain, diffusers' group offloading). On CPU the onload and offload
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
        assert hasattr(pipe.pipe.transformer, "_hf_hook")
    got, _ = run_qwen(pipe)
    torch.testing.assert_close(got, plain, atol=1e-6, rtol=0)


def test_model_offload_chains_the_components_in_a_ring(qwen_dir):
    """``"model"``: each component's hook evicts the one that ran before it, and the first (the next request's
    text encoder) evicts the last (the previous request's VAE), so no component stays on the device between
    requests. On CPU the eviction itself is a no-op, so the chain of accelerate's hooks is what is checked."""
    pipe = load(qwen_dir, offload="model")
    order = pipe.omni_optimizations["components"]
    modules = [getattr(pipe.pipe, name) for name in order]
    for i, module in enumerate(modules):
        prev = module._hf_hook.prev_module_hook
        assert prev is not None, f"{order[i]} evicts nothing"
        assert prev.model is modules[i - 1], f"{order[i]} evicts {type(prev.model).__name__}, not {order[i - 1]}"


def test_offload_with_several_ranks_on_one_device_is_refused_before_workers():
    from omni_core.entrypoints.omni import Omni

    with pytest.raises(ConfigError, match="ranks on 1 cpu device") as exc:
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

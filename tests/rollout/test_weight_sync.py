"""Weight sync without a restart (issue #52): after an update from tensors (in process, and into a model process of
the ``mp`` executor) or from a safetensors file, the engine gives what a fresh engine loaded with those weights
gives and the same checksum; an update with a wrong shape, an unknown or a missing tensor is refused and the
checksum and outputs stay the old ones; release then resume leaves outputs unchanged and a submission meanwhile is
refused naming ``resume_memory``; with ``in_flight="abort"`` a request running during the update is answered
(aborted), with ``"finish"`` it completes on the old weights."""

from __future__ import annotations

import shutil
import threading

import pytest
import torch

from omni_core.errors import OmniError

FIELDS = dict(num_inference_steps=4, output_type="pt", height=32, width=32)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(the shapes folder, a copy whose transformer a 'trainer' changed, the changed tensors)."""
    from safetensors.torch import load_file, save_file

    from omni_core.pipelines import resolve_model

    base = resolve_model("shapes").model_path
    folder = tmp_path_factory.mktemp("trained") / "shapes"
    shutil.copytree(base, folder)
    weights = folder / "transformer" / "diffusion_pytorch_model.safetensors"
    g = torch.Generator().manual_seed(0)
    new = {k: (v + 0.05 * torch.randn(v.shape, generator=g, dtype=torch.float32).to(v.dtype)
               if v.is_floating_point() else v) for k, v in load_file(str(weights)).items()}
    save_file(new, str(weights))
    return base, str(folder), new


def _image(omni, seed=3):
    return omni.generate("a red circle in the top left", seed=seed, use_tqdm=False, **FIELDS)[0].tensor


@pytest.fixture(scope="module")
def fresh(trained):
    """What a fresh engine loaded with the trained weights gives, and its checksum."""
    from omni_core import Omni

    with Omni(trained[1], warmup=False, cpu_threads=1) as omni:
        return _image(omni), omni.weights_checksum()


@pytest.mark.parametrize("executor", ["uni", "mp"])
def test_an_update_from_tensors_equals_a_fresh_engine_and_a_bad_one_changes_nothing(trained, fresh, executor):
    from omni_core import Omni

    base, _, new = trained
    with Omni(base, warmup=False, cpu_threads=1, executor=executor) as omni:
        before, old_sum = _image(omni), omni.weights_checksum()
        name = next(iter(new))
        bad = {"wrong shape": {**new, name: torch.zeros(3, 3)}, "unknown": {**new, "nope.weight": torch.zeros(1)},
               "missing": {k: v for k, v in new.items() if k != name}}
        for why, tensors in bad.items():
            with pytest.raises(OmniError) as err:
                omni.update_weights(tensors)
            assert "nothing was changed" in str(err.value), why
            assert omni.weights_checksum() == old_sum and torch.equal(_image(omni), before), why
        checksum = omni.update_weights(new)
        assert checksum == fresh[1] != old_sum and omni.weights_checksum() == checksum
        assert torch.equal(_image(omni), fresh[0])


def test_an_update_from_a_file_and_release_then_resume(trained, fresh):
    from omni_core import Omni

    base, folder, _ = trained
    with Omni(base, warmup=False, cpu_threads=1) as omni:
        omni.update_weights(f"{folder}/transformer/diffusion_pytorch_model.safetensors")
        assert torch.equal(_image(omni), fresh[0])
        freed = omni.release_memory()
        assert freed > 0 and omni.stats()["dead"] is None
        with pytest.raises(OmniError, match="resume_memory"):
            _image(omni)
        assert omni.resume_memory() == freed
        assert torch.equal(_image(omni), fresh[0]) and omni.weights_checksum() == fresh[1]


@pytest.mark.parametrize("in_flight", ["abort", "finish"])
def test_a_request_running_during_an_update_is_answered(trained, in_flight):
    from omni_core import Omni
    from omni_core.config import SamplingParams
    from omni_core.request import OmniDiffusionRequest

    base, _, new = trained
    with Omni(base, warmup=False, cpu_threads=1, step_execution=True) as omni:
        old = _image(omni)
        params = SamplingParams(seed=3, **{**FIELDS, "num_inference_steps": 40})
        old40 = omni.generate("a red circle in the top left", params, use_tqdm=False)[0].tensor
        stepped = threading.Event()
        req = OmniDiffusionRequest(prompt="a red circle in the top left", sampling_params=params)
        (handle,) = omni.engine.submit([req], on_progress=lambda *a: stepped.set())
        assert stepped.wait(60)
        omni.update_weights(new, in_flight=in_flight, timeout=120)
        out = handle.result(timeout=60)
        assert out.status == ("aborted" if in_flight == "abort" else "completed")
        if in_flight == "finish":  # every step on the old weights: what the old model gave for 40 steps
            assert torch.equal(out.tensor, old40)
        assert not torch.equal(_image(omni), old)  # later requests run on the new weights


def test_lora_only_sync_equals_a_fresh_engine_with_that_adapter(tmp_path):
    """``update_lora("a", tensors)``: requests asking for ``lora="a"`` then equal a fresh engine whose ``a`` is
    that adapter; an adapter diffusers cannot load (another rank's shapes) is refused and ``a`` keeps serving."""
    from safetensors.torch import load_file

    from omni_core import Omni
    from omni_core.lora.testing import make_lora
    from omni_model_qwen_image.testing import build_tiny_qwen_image

    targets = ("to_q", "to_k", "to_v", "to_out.0")
    folder = build_tiny_qwen_image(tmp_path / "qwen")
    first, second = (make_lora(folder, str(tmp_path / n), rank=4, seed=s, std=0.5, targets=targets)
                     for n, s in (("first", 1), ("second", 2)))

    def image(omni):
        return omni.generate("a cat", seed=2, lora="a", use_tqdm=False, **FIELDS)[0].tensor

    with Omni(folder, warmup=False, cpu_threads=1, loras={"a": second}) as omni:
        want = image(omni)
    with Omni(folder, warmup=False, cpu_threads=1, loras={"a": first}) as omni:
        before = image(omni)
        new = load_file(second)
        broken = {k: (v[:2] if k.endswith("lora_A.weight") else v) for k, v in new.items()}
        with pytest.raises(OmniError, match="keeps its previous one"):
            omni.update_lora("a", broken)
        assert torch.equal(image(omni), before)
        omni.update_lora("a", new)
        assert torch.equal(image(omni), want) and not torch.equal(want, before)


def test_an_update_shared_by_another_process_through_shared_memory(trained, fresh):
    import multiprocessing

    from omni_core import Omni
    from omni_core.utils.shared_tensors import send_shared

    base, _, new = trained
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    trainer = ctx.Process(target=send_shared, args=(new, queue))  # a trainer process: shares, sends the handle
    trainer.start()
    handle = queue.get(timeout=120)
    trainer.join(60)
    try:
        assert len(handle.entries) == len(new)  # only names, dtypes, shapes and offsets crossed the pipe
        with Omni(base, warmup=False, cpu_threads=1, executor="mp") as omni:
            assert omni.update_weights(handle) == fresh[1]
            assert torch.equal(_image(omni), fresh[0])
    finally:
        handle.close()


def test_async_omni_awaits_the_same_operations(trained, fresh):
    import asyncio

    from omni_core import AsyncOmni

    base, _, new = trained

    async def run():
        async with AsyncOmni(base, warmup=False, cpu_threads=1) as omni:
            checksum = await omni.update_weights(new)
            assert checksum == await omni.weights_checksum() == fresh[1]
            assert await omni.release_memory() == await omni.resume_memory() > 0
            encoded = await omni.encode("a red circle")
            assert encoded["prompt_embeds"].dim() == 3

    asyncio.run(run())

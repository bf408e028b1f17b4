"""Features together on the diffusers backend (request mode): cache-dit, a LoRA on one of two requests, streamed
previews and batching in one engine: each request streams its previews, reuses steps, and stays within 30 dB of the
same request run without the cache."""

from __future__ import annotations

import math

import pytest

from omni_model_diffusers.parity import omni_fields
from omni_model_diffusers.testing import FAMILIES


def _run(path, lora, **options):
    from omni_core import Omni
    from omni_core.config import SamplingParams
    from omni_core.request import OmniDiffusionRequest

    fields = {**omni_fields(FAMILIES["sana"].call_kwargs), "num_inference_steps": 12}
    reqs = [OmniDiffusionRequest(prompt=p, sampling_params=SamplingParams(seed=i, output_type="pt", **fields, **kw))
            for i, (p, kw) in enumerate([("a cat", {"lora": "style", "lora_scale": 0.7}), ("a dog", {})])]
    with Omni(path, pipeline="diffusers", warmup=False, cpu_threads=1, max_num_seqs=2, loras={"style": lora},
              **options) as omni:
        streams = omni.engine.submit(reqs)
        runs = []
        for stream in streams:
            outs = [stream.get(timeout=120)]
            while not outs[-1].finished:
                outs.append(stream.get(timeout=120))
            runs.append(outs)
    return runs


def test_cache_dit_lora_previews_and_batching_together(family, tmp_path):
    pytest.importorskip("omni_cache_dit")
    pytest.importorskip("peft")
    from omni_core.lora.testing import make_lora

    path = family("sana")
    lora = make_lora(path, str(tmp_path / "style"))
    cached = _run(path, lora, cache_backend="cache_dit", streaming_output=True,
                  cache_config={"residual_diff_threshold": 0.3, "max_warmup_steps": 3})
    plain = _run(path, lora)
    for with_cache, without in zip(cached, plain):
        final, ref = with_cache[-1], without[-1]
        assert final.status == "completed" and final.metrics["steps_reused"] >= 3
        assert [o.step_index for o in with_cache[:-1]] == list(range(1, 13))  # a preview per step
        mse = ((final.images[0] - ref.images[0]) ** 2).mean().item()
        assert mse == 0 or 10 * math.log10(1 / mse) >= 30
    assert not (cached[0][-1].images[0] - cached[1][-1].images[0]).abs().max() == 0

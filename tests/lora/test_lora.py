"""LoRA per request (docs/lora.md): parity with diffusers' ``load_lora_weights`` + ``set_adapters``, mixed
batches equal to each request alone (request mode, and step mode with staggered admission), the checks before
any work, the LRU cache, abort.

Parity: at most one level of 255 per pixel from diffusers' image/video for the same folder, seed and adapter.
"""

from __future__ import annotations

import base64
import io
import os
import threading

import pytest
import numpy as np
import torch

from omni_core.config import SamplingParams
from omni_core.errors import ConfigError
from omni_core.request import OmniDiffusionRequest

NEG = "blurry, low quality"
PROMPT = "a red fox in the snow"
QWEN = dict(height=32, width=32, num_inference_steps=3, true_cfg_scale=4.0, seed=7, output_type="pt")
WAN = dict(height=16, width=16, num_frames=9, num_inference_steps=3, guidance_scale=6.0, seed=7,
           max_sequence_length=32, output_type="pt")
#: (adapter, scale) cases: None = no adapter
MIX = [("a", 1.0), ("b", 0.7), (None, 1.0)]


def levels(x: torch.Tensor, y: torch.Tensor) -> float:
    return ((x * 255).round() - (y * 255).round()).abs().max().item()


def lora_of(name, loras, by_name=("a",)):
    """What a request sends: a preloaded adapter by name, the others by path."""
    return None if name is None else (name if name in by_name else loras[name])


def submit(omni, cases, loras, base, on_progress=None):
    reqs = [omni.engine.prepare_request(OmniDiffusionRequest(
        prompt=PROMPT, negative_prompt=NEG, sampling_params=SamplingParams(
            **base, lora=lora_of(n, loras), lora_scale=s))) for n, s in cases]
    return omni.engine.submit(reqs, on_progress=on_progress)


def run(omni, cases, loras, base, on_progress=None):
    outs = [h.result() for h in submit(omni, cases, loras, base, on_progress)]
    assert all(o.status == "finished" or o.error is None for o in outs), [o.error for o in outs]
    return outs


def assert_nothing_left(omni):
    stats = omni.stats()
    assert stats["waiting"] == 0 and stats["running"] == 0 and not stats["tracked_requests"], stats
    lora = omni.engine.executor.runner.lora
    assert not lora.active and not any(lora.users.values())


_ALONE: dict = {}


def alone(omni, case, loras, base):
    key = (id(omni), case)
    if key not in _ALONE:
        _ALONE[key] = run(omni, [case], loras, base)[0].tensor
    return _ALONE[key]


def diffusers_reference(pipe, loras, case, **call):
    """diffusers' own: ``load_lora_weights`` once per adapter, then ``set_adapters(name, scale)`` (or none)."""
    name, scale = case
    for n in ("a", "b"):
        if n not in pipe.get_list_adapters().get("transformer", []):
            pipe.load_lora_weights(loras[n], adapter_name=n)
    if name is None:
        pipe.disable_lora()
    else:
        pipe.enable_lora()
        pipe.set_adapters(name, scale)
    return call


@pytest.fixture(scope="module")
def diffusers_qwen(qwen_dir):
    from omni_core.pipelines.diffusers_folder import load_diffusers_pipeline

    return load_diffusers_pipeline(qwen_dir)


@pytest.fixture(scope="module")
def diffusers_wan(wan_dir):
    from omni_core.pipelines.diffusers_folder import load_diffusers_pipeline

    return load_diffusers_pipeline(wan_dir)


@pytest.mark.parametrize("case", MIX[:2], ids=["a", "b-0.7"])
def test_qwen_image_equals_diffusers(qwen_omni, diffusers_qwen, qwen_loras, case):
    diffusers_reference(diffusers_qwen, qwen_loras, case)
    ref = diffusers_qwen(PROMPT, negative_prompt=NEG, true_cfg_scale=4.0, height=32, width=32, num_inference_steps=3,
                         output_type="pt", generator=torch.Generator("cpu").manual_seed(7)).images
    out = alone(qwen_omni, case, qwen_loras, QWEN)
    assert out.shape == ref.shape
    assert levels(out, ref) <= 1
    base = alone(qwen_omni, (None, 1.0), qwen_loras, QWEN)
    assert levels(out, base) >= 3, "the adapter changes the image"


@pytest.mark.parametrize("case", MIX[:2], ids=["a", "b-0.7"])
def test_wan_equals_diffusers(wan_omni, diffusers_wan, wan_loras, case):
    diffusers_reference(diffusers_wan, wan_loras, case)
    ref = diffusers_wan(PROMPT, negative_prompt=NEG, guidance_scale=6.0, height=16, width=16, num_frames=9,
                        num_inference_steps=3, max_sequence_length=32, output_type="pt",
                        generator=torch.Generator("cpu").manual_seed(7)).frames
    out = alone(wan_omni, case, wan_loras, WAN)
    assert out.shape == ref.shape
    assert levels(out, ref) <= 1
    assert levels(out, alone(wan_omni, (None, 1.0), wan_loras, WAN)) >= 3


def assert_each_alone(omni, cases, outs, loras, cfg, distinct: bool = True) -> None:
    """Each output equals its request run alone; with ``distinct``, the three outputs differ visibly too."""
    for case, out in zip(cases, outs):
        torch.testing.assert_close(out.tensor, alone(omni, case, loras, cfg), atol=1e-5, rtol=0)
    if distinct:
        for i in range(len(outs)):
            for j in range(i + 1, len(outs)):
                assert levels(outs[i].tensor, outs[j].tensor) >= 3


def test_mixed_batch_request_mode_equals_each_alone(qwen_omni, qwen_loras):
    outs = run(qwen_omni, MIX, qwen_loras, QWEN)
    assert [o.metrics["batch_size"] for o in outs] == [3, 3, 3], "one wave"
    assert_each_alone(qwen_omni, MIX, outs, qwen_loras, QWEN)
    assert_nothing_left(qwen_omni)


@pytest.mark.parametrize("cases", [[("a", 1.0), (None, 1.0), ("a", 1.0)], [("a", 1.0), (None, 1.0), ("a", 0.5)],
                                   [("b", 1.0), (None, 1.0), ("b", 1.0)], [("b", 1.0), (None, 1.0), ("b", 0.5)]],
                         ids=["same-scale", "per-row-scale", "alpha-below-rank", "alpha-below-rank-per-row"])
def test_interleaved_rows_of_one_adapter(qwen_omni, qwen_loras, cases):
    """One adapter on rows 0, 2 (cond) and 3, 5 (uncond): the gathered path, with one scale or a scale per row;
    ``b`` (rank 8, alpha 4: peft's own scaling 0.5) checks that the adapter's scaling is kept next to the rows'."""
    outs = run(qwen_omni, cases, qwen_loras, QWEN)
    assert [o.metrics["batch_size"] for o in outs] == [3, 3, 3]
    assert_each_alone(qwen_omni, cases, outs, qwen_loras, QWEN, distinct=False)


def test_wan_mixed_batch_equals_each_alone(wan_omni, wan_loras):
    outs = run(wan_omni, MIX, wan_loras, WAN)
    assert [o.metrics["batch_size"] for o in outs] == [3, 3, 3]
    assert_each_alone(wan_omni, MIX, outs, wan_loras, WAN, distinct=False)


def test_mixed_step_mode_staggered_admission_equals_each_alone(qwen_step_omni, qwen_loras):
    """B joins after A's first step and C after B's: one step wave holds different adapters at different steps."""
    omni = qwen_step_omni
    handles, joined = [], {0: threading.Event(), 1: threading.Event()}

    def progress(rid, step, total):
        for i, h in enumerate(list(handles[:2])):
            if h.request_id == rid and step >= 1:
                joined[i].set()

    waves0 = omni.stats()["timing"]["waves"]
    handles += submit(omni, MIX[:1], qwen_loras, QWEN, progress)
    assert joined[0].wait(60)
    handles += submit(omni, MIX[1:2], qwen_loras, QWEN, progress)
    assert joined[1].wait(60)
    handles += submit(omni, MIX[2:], qwen_loras, QWEN, progress)
    outs = [h.result() for h in handles]
    waves = omni.stats()["timing"]["waves"] - waves0
    assert waves < 3 * QWEN["num_inference_steps"], f"{waves} waves: the requests never shared a step wave"
    assert_each_alone(omni, MIX, outs, qwen_loras, QWEN)
    assert_nothing_left(omni)


def test_lru_keeps_adapters_in_use_and_evicts_the_rest(qwen_step_omni, qwen_loras):
    """max_loras=2 with three adapters running at once: none evicted while in use; two left afterwards."""
    omni = qwen_step_omni
    cases = [("a", 1.0), ("b", 1.0), ("c", 1.0)]
    outs = run(omni, cases, qwen_loras, QWEN)
    lora = omni.engine.executor.runner.lora
    assert len(lora.loaded) == 2
    assert_each_alone(omni, cases, outs, qwen_loras, QWEN, distinct=False)
    assert len(lora.loaded) == 2
    assert_nothing_left(omni)


def test_lru_evicts_an_idle_adapter_before_loading_another(qwen_step_omni, qwen_loras):
    """max_loras=2 with two idle adapters loaded: a request for a third evicts the least recently used one first,
    so no more than two are ever loaded while it runs."""
    omni = qwen_step_omni
    lora = omni.engine.executor.runner.lora
    run(omni, [("a", 1.0), ("b", 1.0)], qwen_loras, QWEN)
    assert len(lora.loaded) == 2 and not any(lora.users.values())
    seen: list[int] = []
    run(omni, [("c", 1.0)], qwen_loras, dict(QWEN, num_inference_steps=2),
        on_progress=lambda rid, step, total: seen.append(len(lora.loaded)))
    assert seen and max(seen) <= 2, f"adapters loaded while the third ran: {seen} (max_loras=2)"
    assert qwen_loras["c"] in lora.loaded and qwen_loras["b"] in lora.loaded and len(lora.loaded) == 2
    assert_nothing_left(omni)


def test_abort_releases_the_adapter(qwen_step_omni, qwen_loras):
    omni = qwen_step_omni
    started = threading.Event()
    (h,) = submit(omni, [("b", 1.0)], qwen_loras, dict(QWEN, num_inference_steps=50),
                  on_progress=lambda rid, step, total: started.set())
    assert started.wait(60)
    h.abort()
    assert h.result().status == "aborted"
    assert_nothing_left(omni)


@pytest.mark.parametrize("params, field, words", [
    (dict(lora="nope"), "lora", "not a known adapter (loaded by name: a)"),
    (dict(lora="/tmp/missing-adapter.safetensors"), "lora", "no such file"),
    (dict(lora="/tmp/adapter.bin"), "lora", "not a .safetensors file"),
    (dict(lora="WAN"), "lora", "not in this model's transformer"),
    (dict(lora="BIG"), "lora", "rank 16, above max_lora_rank=8"),
])
def test_refused_before_any_work(qwen_omni, qwen_loras, wan_loras, params, field, words):
    lora = {"WAN": wan_loras["a"], "BIG": qwen_loras["big"]}.get(params["lora"], params["lora"])
    added = qwen_omni.stats()["requests_added"]
    with pytest.raises(ConfigError) as err:
        qwen_omni.generate(PROMPT, SamplingParams(**dict(QWEN, lora=lora)))
    assert err.value.field == field and words in str(err.value), str(err.value)
    assert qwen_omni.stats()["requests_added"] == added
    assert_nothing_left(qwen_omni)


@pytest.mark.parametrize("scale", [float("nan"), 11.0, "1"])
def test_bad_scale_names_the_field(scale):
    with pytest.raises(ConfigError) as err:
        SamplingParams(lora="a", lora_scale=scale)
    assert err.value.field == "lora_scale"


def test_preloaded_adapter_must_fit(qwen_dir, wan_loras):
    from omni_core import Omni

    with pytest.raises(ConfigError) as err:
        Omni(qwen_dir, dtype="float32", loras={"w": wan_loras["a"]})
    assert err.value.field == "loras" and "not in this model's transformer" in str(err.value)


# ------------------------------------------------------------------ the server, worker processes, a cache backend
def test_server_lora_fields(qwen_omni, qwen_loras):
    import httpx
    from PIL import Image

    from omni_core.serve import ServerThread, build_app

    body = {"prompt": PROMPT, "negative_prompt": NEG, "size": "32x32", "num_inference_steps": 3,
            "true_cfg_scale": 4.0, "seed": 7}
    # a path is allowed only under a --lora-dir (issue #34)
    with ServerThread(build_app(qwen_omni.engine, lora_dirs=[os.path.dirname(qwen_loras["b"])])) as srv:
        ok = httpx.post(f"{srv.url}/v1/images/generations", json={**body, "lora": qwen_loras["b"], "lora_scale": 0.7},
                        timeout=120)
        assert ok.status_code == 200, ok.text
        png = Image.open(io.BytesIO(base64.b64decode(ok.json()["data"][0]["b64_json"])))
        got = torch.from_numpy(np.array(png.convert("RGB"))).permute(2, 0, 1).float()[None] / 255
        assert levels(got, alone(qwen_omni, ("b", 0.7), qwen_loras, QWEN)) <= 1
        bad = httpx.post(f"{srv.url}/v1/images/generations", json={**body, "lora": "nope"}, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora", bad.text
        chat = httpx.post(f"{srv.url}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": PROMPT}], "extra_body": {"lora": "a", "lora_scale": 99}})
        assert chat.status_code == 400 and chat.json()["error"]["param"] == "lora_scale", chat.text
    assert_nothing_left(qwen_omni)


@pytest.mark.slow  # a worker process start; the per-row path is the same code as in-process (covered above)
def test_mp_workers_load_adapters_on_demand(qwen_dir, qwen_omni, qwen_loras):
    """A worker process loads the preloaded name and a path on demand; same images as in-process."""
    from omni_core import Omni

    with Omni(qwen_dir, dtype="float32", executor="mp", max_num_seqs=3, max_lora_rank=8, warmup=False,
              loras={"a": qwen_loras["a"]}) as mp:
        outs = run(mp, MIX, qwen_loras, QWEN)
        assert mp.stats()["tracked_requests"] == []
    assert_each_alone(qwen_omni, MIX, outs, qwen_loras, QWEN, distinct=False)


def test_tea_cache_mixed_batch_keeps_state_per_request(qwen_dir, qwen_loras):
    from omni_core import Omni

    with Omni(qwen_dir, dtype="float32", max_num_seqs=3, max_lora_rank=8, warmup=False, cache_backend="tea_cache",
              cache_config={"rel_l1_thresh": 0.6}, loras={"a": qwen_loras["a"]}) as tea:
        base = dict(QWEN, num_inference_steps=6)
        mixed = run(tea, MIX, qwen_loras, base)
        single = [run(tea, [case], qwen_loras, base)[0] for case in MIX]
        assert_nothing_left(tea)
    assert any(o.metrics["steps_reused"] > 0 for o in single), [o.metrics for o in single]
    for m, s in zip(mixed, single):
        assert m.metrics["steps_reused"] == s.metrics["steps_reused"]
        torch.testing.assert_close(m.tensor, s.tensor, atol=1e-5, rtol=0)
    assert levels(mixed[0].tensor, mixed[1].tensor) >= 3


def test_omni_lora_inspect(qwen_dir, qwen_loras, wan_loras, capsys):
    import json

    from omni_core.cli.main import main

    assert main(["lora", "inspect", qwen_loras["b"], "--model", qwen_dir, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["format"], report["rank"], report["alpha"], report["fits"]) == ("diffusers/peft", 8, 4, True)
    assert "add_q_proj" in report["target_modules"] and report["components"] == ["transformer"]
    assert main(["lora", "inspect", wan_loras["a"], "--model", qwen_dir, "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert not report["fits"] and "not in this model's transformer" in report["problems"][0]


TEA = {"cache_backend": "tea_cache", "cache_config": {"rel_l1_thresh": 0.6}}
TEA_QWEN = dict(QWEN, num_inference_steps=6)


def _offload_case_outputs(omni, loras):
    """The adapters' requests of the offload test: a wave loading ``b`` beside ``a`` (then one evicted), then ``b``
    alone with ``a`` evicted."""
    return run(omni, MIX, loras, TEA_QWEN) + run(omni, [("b", 1.0)], loras, TEA_QWEN)


@pytest.fixture(scope="module")
def tea_reference(qwen_dir, qwen_loras):
    from omni_core import Omni

    with Omni(qwen_dir, dtype="float32", max_num_seqs=3, max_loras=1, max_lora_rank=8, warmup=False,
              loras={"a": qwen_loras["a"]}, **TEA) as omni:
        return _offload_case_outputs(omni, qwen_loras)


@pytest.mark.parametrize("mode", ["model", "group"])
def test_offload_keeps_its_hooks_through_adapter_loads_and_unloads(qwen_dir, tea_reference, qwen_loras, mode):
    """diffusers' ``load_lora_weights`` strips accelerate's offload hooks and re-enables its own offload without a
    device (on CPU it raises), and re-applies group offloading by rewriting ``forward``: with ``offload`` set,
    adapters loaded and evicted at run time (an LRU of one) leave every offload hook and our own hooks (the
    cache's, which must still skip steps) in place, and the images equal the engine without offload."""
    from diffusers.hooks import HookRegistry as DiffusersHooks

    from omni_core import Omni
    from omni_core.hooks import hook_names

    with Omni(qwen_dir, dtype="float32", offload=mode, max_num_seqs=3, max_loras=1, max_lora_rank=8, warmup=False,
              loras={"a": qwen_loras["a"]}, **TEA) as omni:
        pipe = omni.engine.executor.runner.pipeline
        ours = hook_names(pipe.pipe.transformer)
        assert ours, "the cache's hook is on the transformer"
        outs = _offload_case_outputs(omni, qwen_loras)
        assert len(omni.engine.executor.runner.lora.loaded) == 1
        for name in ("text_encoder", "transformer", "vae"):
            module = getattr(pipe.pipe, name)
            if mode == "model":
                assert "offload.model" in hook_names(module), name
                assert not hasattr(module._hf_hook, "hooks"), name  # ours, not accelerate's
            else:
                assert "group_offloading" in DiffusersHooks.check_if_exists_or_initialize(module).hooks, name
        assert hook_names(pipe.pipe.transformer) == ours
    assert outs[-1].metrics["steps_reused"] > 0, "the cache still runs after the adapters changed"
    for out, ref in zip(outs, tea_reference):
        assert out.metrics["steps_reused"] == ref.metrics["steps_reused"]
        torch.testing.assert_close(out.tensor, ref.tensor, atol=1e-5, rtol=0)

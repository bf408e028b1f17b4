"""The RL routes in SGLang diffusion's shape (issue #52) on a live server over ``shapes``: ``/rollout/generate``
answers msgpack (or JSON) with one dict per sample whose tensors decode as SGLang encodes them and whose
log-probs equal the Python API's for the same request; limits and unknown fields are refused naming them; the
API key is required; ``/update_weights_from_tensor`` changes the checksum ``/get_weights_checksum`` reports and a
wrong shape is a 400 that leaves it; release then resume keeps the answers."""

from __future__ import annotations

import pytest
import torch

from omni_core.serve.routes.rollout import RolloutLimits, decode_tensor, encode_tensor

BODY = {"prompt": "a red circle in the top left", "seed": 3, "width": 32, "height": 32, "num_inference_steps": 4,
        "num_outputs_per_prompt": 2, "guidance_scale": 1.0, "rollout": True, "rollout_sde_type": "sde",
        "rollout_noise_level": 0.8, "rollout_sde_step_indices": [1, 2], "rollout_return_dit_trajectory": True,
        "rollout_debug_mode": True}


@pytest.fixture(scope="module")
def live(start_server):
    return start_server("shapes", {"warmup": False, "cpu_threads": 1, "limits": {"max_outputs": 8}},
                        rollout_limits=RolloutLimits(max_samples=4, max_trajectory_steps=8))


def test_rollout_generate_in_sglangs_shape_with_the_python_apis_log_probs(live):
    import msgpack

    from omni_core import Omni

    with live.client() as client:
        r = client.post("/rollout/generate", json=BODY)
        assert r.status_code == 200 and r.headers["content-type"] == "application/msgpack", r.text
        samples = msgpack.unpackb(r.content, raw=False)
        as_json = client.post("/rollout/generate", json=BODY, headers={"Accept": "application/json"}).json()
        assert client.post("/rollout/generate", json=BODY, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert len(samples) == 2 and [s["seed"] for s in samples] == [3, 3]
    for key in ("request_id", "prompt", "generated_output", "rollout_log_probs", "rollout_debug_tensors",
                "denoising_env", "dit_trajectory", "inference_time_s", "peak_memory_mb"):
        assert key in samples[0]
    log_probs = torch.stack([decode_tensor(s["rollout_log_probs"], "x") for s in samples])
    assert torch.equal(log_probs, torch.stack([decode_tensor(s["rollout_log_probs"], "x") for s in as_json]))
    trajectory = samples[0]["dit_trajectory"]
    assert trajectory["latent_step_indices"] == [1, 2, 3]
    assert decode_tensor(trajectory["latents"], "x").shape == (3, 3, 32, 32)
    assert decode_tensor(samples[0]["generated_output"], "x").shape == (3, 32, 32)
    with Omni("shapes", warmup=False, cpu_threads=1) as omni:  # the same request through the Python API
        out = omni.generate(BODY["prompt"], seed=3, height=32, width=32, num_inference_steps=4, guidance_scale=1.0,
                            num_outputs_per_prompt=2, output_type="pt", use_tqdm=False,
                            rollout={"sde_type": "sde", "noise_level": 0.8, "sde_steps": [1, 2]})[0]
    assert torch.equal(log_probs, out.rollout["log_probs"])


@pytest.mark.parametrize("change, field", [
    ({"num_outputs_per_prompt": 5}, "num_outputs_per_prompt"),
    ({"num_inference_steps": 9}, "num_inference_steps"),
    ({"rollout_sde_typo": "sde"}, "rollout_sde_typo"),
    ({"rollout_sde_type": "sdee"}, "sde_type"),
    ({"rollout_return_denoising_env": True}, "rollout_return_denoising_env"),
])
def test_what_a_request_may_ask_is_bounded_and_named(live, change, field):
    with live.client() as client:
        r = client.post("/rollout/generate", json={**BODY, **change})
    assert r.status_code == 400 and field in r.text, r.text


def test_weight_routes_change_the_checksum_all_or_nothing_and_release_resume(live):
    from omni_core.pipelines import resolve_model
    from safetensors.torch import load_file

    base = load_file(f"{resolve_model('shapes').model_path}/transformer/diffusion_pytorch_model.safetensors")
    with live.client() as client:
        def checksum():
            return client.post("/get_weights_checksum", json={"module_names": ["transformer"]}).json()["transformer"]

        def image():
            r = client.post("/rollout/generate", json={**BODY, "rollout": False}, headers={"Accept": "application/json"})
            return decode_tensor(r.json()[0]["generated_output"], "x")

        before, old = checksum(), image()
        name = next(iter(base))
        bad = client.post("/update_weights_from_tensor", json={
            "serialized_named_tensors": {name: encode_tensor(torch.zeros(2, 2))}, "weight_update_mode": "partial"})
        assert bad.status_code == 400 and name in bad.text and checksum() == before
        changed = {name: encode_tensor(base[name] + 0.5)}
        ok = client.post("/update_weights_from_tensor", json={"serialized_named_tensors": changed,
                                                              "weight_update_mode": "partial"})
        assert ok.status_code == 200 and ok.json()["checksum"] == checksum() != before
        assert client.post("/release_memory_occupation").json()["released_bytes"] > 0
        assert client.post("/rollout/generate", json=BODY).status_code >= 400  # refused while released
        assert client.post("/resume_memory_occupation").json()["restored_bytes"] > 0
        restored = client.post("/update_weights_from_tensor", json={
            "serialized_named_tensors": {name: encode_tensor(base[name])}, "weight_update_mode": "partial"})
        assert restored.json()["checksum"] == before and torch.equal(image(), old)


def test_encode_gives_the_models_text_encodings(live):
    from omni_core import Omni

    with live.client() as client:
        r = client.post("/encode", json={"prompt": "a red circle", "guidance_scale": 4.0, "negative_prompt": "blue"})
        assert r.status_code == 200, r.text
        got = {k: decode_tensor(v, k) for k, v in r.json().items() if v is not None}
        assert client.post("/encode", json={"promt": "x"}).status_code == 400
    with Omni("shapes", warmup=False, cpu_threads=1) as omni:
        want = omni.encode("a red circle", negative_prompt="blue", guidance_scale=4.0)
    assert set(got) == {"prompt_embeds", "prompt_mask", "negative_prompt_embeds", "negative_prompt_mask"}
    assert all(torch.equal(got[k], want[k]) for k in got)
    from omni_core.testing import load_model

    embeds, mask = load_model("shapes").encode_prompt("a red circle", None)  # the model's own encoder, directly
    assert torch.equal(got["prompt_embeds"], embeds) and torch.equal(got["prompt_mask"], mask)

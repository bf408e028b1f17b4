"""The requests vLLM-Omni's own clients send, sent exactly so (issue #37), against live servers on tiny models.
Nothing of vLLM-Omni is vendored: each test names the file and commit of github.com/vllm-project/vllm-omni whose
request it reproduces; sizes, steps and frame counts are scaled down to the tiny models (and Wan's 4k+1 frames).

* older ``examples/online_serving/text_to_image/openai_chat_client.py`` (be81443c): chat, ``num_outputs_per_prompt``
  in ``extra_body``; reads ``choices[0].message.content[0].image_url.url``.
* older ``benchmarks/diffusion_benchmark_serving.py`` (beb474b6): every task through ``/v1/chat/completions`` (video
  too), reads ``peak_memory_mb`` at the top level of the response.
* older ``examples/online_serving/text_to_video/run_curl_text_to_video.sh`` (31d4ce62): video through chat, reads
  the ``video_url`` part.
* newer ``examples/online_serving/text_to_video/README.md`` (3a103124) and ``image_to_video/README.md`` (1c153fe4):
  multipart ``/v1/videos`` with ``guidance_scale_2``, ``boundary_ratio``, ``flow_shift``.
* newer ``vllm_omni/entrypoints/openai/protocol/videos.py`` (079d7a56): ``extra_params``, ``video_params``,
  ``generate_sound``, ``enable_frame_interpolation``.
* newer (3bd8a523) ``examples/online_serving/text_to_video/README.md`` (7b965a7b): ``POST /v1/videos/sync``;
  ``image_to_video/README.md`` (7b965a7b): ``image_reference``; ``text_to_video/run_curl_text_to_video.sh`` and
  ``image_to_video/run_curl_image_to_video.sh`` (92f771d4): ``seconds=2`` at ``fps=16`` (32 frames, 4k+1: 33);
  ``benchmarks/diffusion/backends.py`` (c139ee4a): the ``v1/videos`` backend's url-encoded form, poll, content,
  delete.
* ``num_frames`` off Wan's 4k+1 is rounded as diffusers' ``WanPipeline`` and vLLM-Omni's ``pipeline_wan2_2.py``
  (3bd8a523) round it (``n // 4 * 4 + 1``), said in the response's ``warnings``; ``extra_params.sample_solver``
  (Wan's reference solver names) picks the diffusers scheduler.
"""

from __future__ import annotations

import base64
import io
import time

import numpy as np
import pytest

pytest.importorskip("omni_model_wan", reason="the video cases use the Wan model plugin (omni-model-wan)")
pytest.importorskip("imageio_ffmpeg", reason="MP4 writing needs imageio-ffmpeg")


def mp4_frames(data: bytes, tmp_path) -> list:
    import imageio.v2 as imageio

    path = tmp_path / "v.mp4"
    path.write_bytes(data)
    with imageio.get_reader(str(path)) as reader:
        return [frame for frame in reader]


def png(width: int = 16, height: int = 16) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def wan22_server(start_server, tmp_path_factory):
    """A tiny two-expert Wan 2.2 text-to-video folder (``boundary_ratio`` 0.875, flow-match shift 7)."""
    from omni_model_wan.testing import build_tiny_wan

    folder = build_tiny_wan(tmp_path_factory.mktemp("tiny-wan22"), two_experts=True)
    return start_server(folder, {"streaming_output": True, "warmup": False, "max_num_seqs": 2},
                        served_model_name="tiny-wan22", video_dir=str(tmp_path_factory.mktemp("wan22-videos")))


def poll(client, job_id: str, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        job = client.get(f"/v1/videos/{job_id}").json()
        if job["status"] in ("completed", "failed"):
            return job
        assert time.monotonic() < deadline, job
        time.sleep(0.05)


# ------------------------------------------------------------------------------------------ chat, images
def test_older_text_to_image_chat_client_with_num_outputs_per_prompt(server):
    # examples/online_serving/text_to_image/openai_chat_client.py @ be81443c: generate_image(prompt, height=,
    # width=, steps=, seed=, negative_prompt=, num_outputs_per_prompt=2)
    payload = {"messages": [{"role": "user", "content": "a red circle"}],
               "extra_body": {"height": 16, "width": 16, "num_inference_steps": 2, "seed": 42,
                              "negative_prompt": "blurry", "num_outputs_per_prompt": 2}}
    with server.client() as c:
        r = c.post("/v1/chat/completions", headers={"Content-Type": "application/json"}, json=payload)
        assert r.status_code == 200, r.text
        content = r.json()["choices"][0]["message"]["content"]
        assert len(content) == 2 and content[0]["image_url"]["url"].startswith("data:image/png;base64,")
        both = c.post("/v1/chat/completions", json={**payload, "extra_body": {**payload["extra_body"], "n": 2}})
    assert both.status_code == 400 and both.json()["error"]["param"] == "num_outputs_per_prompt"
    assert "not both" in both.json()["error"]["message"]


def test_older_benchmark_reads_peak_memory_at_the_top_level(server):
    # benchmarks/diffusion_benchmark_serving.py @ beb474b6, async_request_chat_completions with the t2i defaults:
    # payload {"model", "messages", "extra_body": {height, width, num_inference_steps, seed}}; then
    # ``if "peak_memory_mb" in resp_json: output.peak_memory_mb = resp_json["peak_memory_mb"]``
    payload = {"model": "default", "messages": [{"role": "user", "content": "a blue square"}],
               "extra_body": {"height": 16, "width": 16, "num_inference_steps": 2, "seed": 0}}
    with server.client() as c:
        resp = c.post("/v1/chat/completions", json=payload).json()
        images = c.post("/v1/images/generations", json={"prompt": "x", "size": "16x16",
                                                        "num_inference_steps": 1}).json()
    assert resp["peak_memory_mb"] > 0 and resp["peak_memory_mb"] == resp["usage"]["peak_memory_mb"]
    assert images["peak_memory_mb"] > 0 and images["peak_memory_mb"] == images["usage"]["peak_memory_mb"]


# ------------------------------------------------------------------------------------------ chat, videos
def test_older_benchmark_and_curl_make_videos_through_chat_completions(wan22_server, tmp_path):
    # benchmarks/diffusion_benchmark_serving.py @ beb474b6 with --task t2v --num-frames --fps (its api_url is always
    # /v1/chat/completions), and examples/online_serving/text_to_video/run_curl_text_to_video.sh @ 31d4ce62, which
    # also sends guidance_scale 4.0 and guidance_scale_2 3.0 and reads
    # ``.choices[0].message.content[] | select(.type=="video_url") | .video_url.url``
    payload = {"model": "default", "messages": [{"role": "user", "content": "A cat surfing on waves"}],
               "extra_body": {"height": 16, "width": 16, "num_frames": 5, "num_inference_steps": 2,
                              "guidance_scale": 4.0, "guidance_scale_2": 3.0, "seed": 42, "fps": 8}}
    with wan22_server.client() as c:
        r = c.post("/v1/chat/completions", json=payload)
        assert r.status_code == 200, r.text
        resp = r.json()
        bad = c.post("/v1/chat/completions", json={**payload, "extra_body": {**payload["extra_body"], "fps": 0}})
    assert resp["peak_memory_mb"] > 0
    (part,) = [p for p in resp["choices"][0]["message"]["content"] if p["type"] == "video_url"]
    url = part["video_url"]["url"]
    assert url.startswith("data:video/mp4;base64,")
    frames = mp4_frames(base64.b64decode(url.split(",", 1)[1]), tmp_path)
    assert len(frames) == 5 and frames[0].shape == (16, 16, 3)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "fps"


# ------------------------------------------------------------------------------------------ /v1/videos
#: examples/online_serving/text_to_video/README.md @ 3a103124, "Generation with Parameters" (curl -F ...), scaled
NEWER_T2V_FORM = {"prompt": "A cinematic view of a futuristic city at sunset", "width": "16", "height": "16",
                  "num_frames": "5", "negative_prompt": "low quality, blurry, static", "fps": "16",
                  "num_inference_steps": "2", "guidance_scale": "4.0", "guidance_scale_2": "4.0",
                  "boundary_ratio": "0.875", "flow_shift": "5.0", "seed": "42"}


def curl_form(fields: dict, files: dict | None = None) -> tuple[bytes, dict]:
    """A ``multipart/form-data`` body as ``curl -F name=value`` (and ``-F name=@file``) sends it."""
    boundary = "------------------------curlform0123456789"
    out = b""
    for name, value in fields.items():
        out += (f"--{boundary}\r\nContent-Disposition: form-data; name=\"{name}\"\r\n\r\n{value}\r\n").encode()
    for name, (filename, data, mime) in (files or {}).items():
        out += (f"--{boundary}\r\nContent-Disposition: form-data; name=\"{name}\"; filename=\"{filename}\"\r\n"
                f"Content-Type: {mime}\r\n\r\n").encode() + data + b"\r\n"
    return out + f"--{boundary}--\r\n".encode(), {"Content-Type": f"multipart/form-data; boundary={boundary}"}


def test_newer_text_to_video_curl_with_boundary_ratio_and_flow_shift(wan22_server, tmp_path):
    with wan22_server.client() as c:
        body, headers = curl_form(NEWER_T2V_FORM)
        created = c.post("/v1/videos", content=body, headers=headers)
        assert created.status_code == 200, created.text
        done = poll(c, created.json()["id"])
        assert done["status"] == "completed", done
        video = mp4_frames(c.get(f"/v1/videos/{done['id']}/content").content, tmp_path)
    assert len(video) == 5


def _run(c, form) -> np.ndarray:
    """One job's frames, through the JSON body (the same fields as the form)."""
    created = c.post("/v1/videos", json=form)
    assert created.status_code == 200, created.text
    done = poll(c, created.json()["id"])
    assert done["status"] == "completed", done
    import imageio.v2 as imageio

    data = c.get(f"/v1/videos/{done['id']}/content").content
    with imageio.get_reader(io.BytesIO(data), format="mp4") as reader:
        return np.stack([f for f in reader]).astype(np.int16)


def test_boundary_ratio_and_flow_shift_are_honoured(wan22_server):
    base = {"prompt": "a cat", "size": "16x16", "num_frames": 5, "num_inference_steps": 4, "seed": 3}
    with wan22_server.client() as c:
        default = _run(c, base)
        same = _run(c, {**base, "boundary_ratio": 0.875, "flow_shift": 7.0})  # the folder's own values
        ratio = _run(c, {**base, "boundary_ratio": 0.2})
        shift = _run(c, {**base, "flow_shift": 2.0})
    assert np.abs(default - same).max() <= 1  # float noise of threaded kernels, at most one level after MP4
    assert np.abs(default - ratio).max() > 4 and np.abs(default - shift).max() > 4


def test_newer_protocol_fields_extra_params_video_params_and_switches(wan22_server):
    # vllm_omni/entrypoints/openai/protocol/videos.py @ 079d7a56
    with wan22_server.client() as c:
        ok = c.post("/v1/videos", json={"prompt": "a cat", "video_params": {"width": 16, "height": 16,
                                                                            "num_frames": 5, "fps": 8},
                                        "num_inference_steps": 2, "generate_sound": False,
                                        "enable_frame_interpolation": False})
        assert ok.status_code == 200, ok.text
        job = ok.json()
        assert job["size"] == "16x16" and job["num_frames"] == 5 and job["fps"] == 8
        poll(c, job["id"])
        refusals = {
            "generate_sound": c.post("/v1/videos", json={"prompt": "x", "generate_sound": True}),
            "enable_frame_interpolation": c.post("/v1/videos", data={"prompt": "x",
                                                                     "enable_frame_interpolation": "true"}),
            "video_params": c.post("/v1/videos", json={"prompt": "x", "video_params": {"depth": 3}}),
            "extra_params": c.post("/v1/videos", json={"prompt": "x", "extra_params": {}, "extra_args": {}}),
        }
    for param, r in refusals.items():
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (param, r.text)


def test_wan22_fields_on_a_one_expert_model_are_refused_naming_them(start_server, tmp_path_factory):
    from omni_model_wan.testing import build_tiny_wan

    live = start_server(build_tiny_wan(tmp_path_factory.mktemp("tiny-wan21")), {"warmup": False},
                        served_model_name="tiny-wan21")
    with live.client() as c:
        body, headers = curl_form({k: v for k, v in NEWER_T2V_FORM.items() if k != "guidance_scale_2"})
        r = c.post("/v1/videos", content=body, headers=headers)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "boundary_ratio" and "two-expert" in err["message"]


def test_a_field_the_served_model_lacks_is_refused_naming_it_and_its_owner(server):
    with server.client() as c:
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                 "extra_body": {"flow_shift": 5.0}})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "flow_shift" and "WanPipeline" in err["message"]


# ------------------------------------------------------------------------------------------ newer clients (3bd8a523)
def test_older_t2v_curl_num_frames_32_is_rounded_to_33_and_said(wan22_server, tmp_path):
    # examples/online_serving/text_to_video/run_curl_text_to_video.sh @ 31d4ce62 sends "num_frames": 32; diffusers'
    # WanPipeline and vllm_omni/diffusion/models/wan2_2/pipeline_wan2_2.py @ 3bd8a523 make 33 frames of it
    payload = {"model": "default", "messages": [{"role": "user", "content": "A cat surfing on waves"}],
               "extra_body": {"height": 16, "width": 16, "num_frames": 6, "num_inference_steps": 2, "seed": 42,
                              "fps": 8}}
    with wan22_server.client() as c:
        r = c.post("/v1/chat/completions", json=payload)
        assert r.status_code == 200, r.text
        job = c.post("/v1/videos", json={"prompt": "a cat", "size": "16x16", "num_frames": 7,
                                         "num_inference_steps": 2}).json()
        done = poll(c, job["id"])
        nonsense = c.post("/v1/videos", json={"prompt": "a cat", "num_frames": 0})
    (part,) = [p for p in r.json()["choices"][0]["message"]["content"] if p["type"] == "video_url"]
    assert len(mp4_frames(base64.b64decode(part["video_url"]["url"].split(",", 1)[1]), tmp_path)) == 5
    assert r.json()["warnings"] == ["num_frames 6 was rounded to 5: WanPipeline makes videos of num_frames - 1 a "
                                    "multiple of 4"]
    assert job["num_frames"] == 5 and "rounded to 5" in job["warnings"][0] and done["status"] == "completed"
    assert nonsense.status_code == 400 and nonsense.json()["error"]["param"] == "num_frames"


def test_newer_curl_scripts_seconds_at_fps_give_4k_plus_1_frames(wan22_server):
    # text_to_video/run_curl_text_to_video.sh @ 92f771d4: -F seconds=2 -F fps=16 (vLLM-Omni: 2 * 16 = 32 frames,
    # rounded by its Wan pipeline to 33); scaled: seconds=1, fps=8 -> 8 frames -> 9
    with wan22_server.client() as c:
        body, headers = curl_form({"prompt": "Two cats", "seconds": "1", "size": "16x16", "fps": "8",
                                   "num_inference_steps": "1", "guidance_scale": "4.0", "guidance_scale_2": "4.0",
                                   "boundary_ratio": "0.875", "flow_shift": "5.0", "seed": "42"})
        job = c.post("/v1/videos", content=body, headers=headers).json()
        assert poll(c, job["id"])["status"] == "completed"
    assert job["num_frames"] == 9 and "warnings" not in job


def test_newer_sync_route_answers_with_the_mp4(wan22_server, tmp_path):
    # examples/online_serving/text_to_video/README.md @ 7b965a7b, "Sync API": curl -X POST /v1/videos/sync -F ...
    # (vllm_omni/entrypoints/openai/api_server.py @ 3bd8a523 create_video_sync: video/mp4 bytes, X-Request-Id,
    # X-Model, X-Inference-Time-S)
    form = {**NEWER_T2V_FORM, "num_frames": "5"}
    with wan22_server.client() as c:
        body, headers = curl_form(form)
        r = c.post("/v1/videos/sync", content=body, headers=headers)
        rounded = c.post("/v1/videos/sync", json={"prompt": "x", "size": "16x16", "num_frames": 4,
                                                  "num_inference_steps": 1})
        bad = c.post("/v1/videos/sync", json={"prompt": "x", "flow_shift": -1})
        listed = c.get("/v1/videos").json()["data"]
    assert r.status_code == 200 and r.headers["content-type"] == "video/mp4", r.text
    assert r.headers["x-model"] == "tiny-wan22" and float(r.headers["x-inference-time-s"]) > 0
    assert r.headers["x-request-id"]
    assert len(mp4_frames(r.content, tmp_path)) == 5
    assert rounded.status_code == 200 and "rounded to 5" in rounded.headers["x-omni-warning"]
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "flow_shift"
    assert not [j for j in listed if j["prompt"] == "x"]  # no job record, as there


def test_newer_benchmark_v1_videos_backend(wan22_server):
    # benchmarks/diffusion/backends.py @ c139ee4a, async_request_v1_videos: an aiohttp FormData without files
    # (application/x-www-form-urlencoded) of str() values, poll GET /v1/videos/{id} until completed or failed,
    # GET .../content, read peak_memory_mb from the polled job, DELETE the job
    form = {"prompt": "Random prompt 0 for benchmarking diffusion models", "height": "16", "width": "16",
            "num_frames": "1", "num_inference_steps": "2", "negative_prompt": "Negative prompt 0"}
    with wan22_server.client() as c:
        created = c.post("/v1/videos", data=form)
        assert created.status_code == 200, created.text
        job = poll(c, created.json()["id"])
        content = c.get(f"/v1/videos/{job['id']}/content")
        deleted = c.delete(f"/v1/videos/{job['id']}")
    assert job["status"] == "completed" and job["peak_memory_mb"] > 0
    assert content.status_code == 200 and content.content[4:8] == b"ftyp"
    assert deleted.status_code == 200


def test_sample_solver_in_extra_params_picks_the_scheduler(wan22_server):
    # vLLM-Omni hands extra_params to the model (protocol/videos.py @ 3bd8a523); Wan's reference solvers are
    # unipc, dpm++ and euler (the tiny folder's own scheduler is flow-match Euler)
    base = {"prompt": "a cat", "size": "16x16", "num_frames": 5, "num_inference_steps": 4, "seed": 3}
    with wan22_server.client() as c:
        default = _run(c, base)
        euler = _run(c, {**base, "extra_params": {"sample_solver": "euler"}})
        unipc = _run(c, {**base, "extra_params": {"sample_solver": "unipc"}})
        body, headers = curl_form({"prompt": "a cat", "extra_params": '{"sample_solver": "dpm++"}', "size": "16x16",
                                   "num_frames": "1", "num_inference_steps": "2"})
        form = c.post("/v1/videos", content=body, headers=headers)
        bad = c.post("/v1/videos", json={**base, "extra_params": {"sample_solver": "heun"}})
        both = c.post("/v1/videos", json={**base, "sample_solver": "euler", "extra_params": {"sample_solver": "euler"}})
        poll(c, form.json()["id"])
    assert np.abs(default - euler).max() <= 1 and np.abs(default - unipc).max() > 4
    assert form.status_code == 200, form.text
    err = bad.json()["error"]
    assert bad.status_code == 400 and err["param"] == "sample_solver", err
    assert all(name in err["message"] for name in ("unipc", "dpm++", "euler")), err
    assert both.status_code == 400 and both.json()["error"]["param"] == "sample_solver"


@pytest.fixture(scope="module")
def wan_i2v_server(start_server, tmp_path_factory):
    """A tiny Wan 2.1 image-to-video folder."""
    from omni_model_wan.testing import build_tiny_wan_i2v

    folder = build_tiny_wan_i2v(tmp_path_factory.mktemp("tiny-wan-i2v"))
    return start_server(folder, {"warmup": False}, served_model_name="tiny-wan-i2v",
                        video_dir=str(tmp_path_factory.mktemp("i2v-videos")))


def test_newer_image_reference_and_input_reference(wan_i2v_server):
    # examples/online_serving/image_to_video/README.md @ 7b965a7b: -F 'image_reference={"image_url": ...}' (a JSON
    # text field), "do not send input_reference and image_reference together"; file_id is refused there too
    url = "data:image/png;base64," + base64.b64encode(png(16, 16)).decode()
    common = {"prompt": "A bear playing with yarn", "size": "16x16", "num_frames": "5", "num_inference_steps": "2",
              "seed": "1"}
    with wan_i2v_server.client() as c:
        body, headers = curl_form({**common, "image_reference": f'{{"image_url": "{url}"}}'})
        by_reference = c.post("/v1/videos", content=body, headers=headers)
        assert by_reference.status_code == 200, by_reference.text
        body, headers = curl_form(common, {"input_reference": ("bear.png", png(16, 16), "image/png")})
        by_file = c.post("/v1/videos", content=body, headers=headers)
        a, b = poll(c, by_reference.json()["id"]), poll(c, by_file.json()["id"])
        same = [c.get(f"/v1/videos/{j['id']}/content").content for j in (a, b)]
        body, headers = curl_form({**common, "image_reference": f'{{"image_url": "{url}"}}'},
                                  {"input_reference": ("bear.png", png(16, 16), "image/png")})
        json_body = {"prompt": "A bear", "size": "16x16", "num_frames": 5, "num_inference_steps": 2}
        refusals = {
            "both": c.post("/v1/videos", content=body, headers=headers),
            "file_id": c.post("/v1/videos", json={**json_body, "image_reference": {"file_id": "file-1"}}),
            "remote": c.post("/v1/videos", json={**json_body, "image_reference": {"image_url": "https://x/b.png"}}),
            "shape": c.post("/v1/videos", json={**json_body, "image_reference": {"url": url}}),
        }
    assert a["status"] == b["status"] == "completed" and same[0] == same[1]
    for why, r in refusals.items():
        assert r.status_code == 400 and r.json()["error"]["param"] == "image_reference", (why, r.text)
    assert "not fetch" in refusals["remote"].json()["error"]["message"]

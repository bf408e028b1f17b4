"""``/v1/videos`` jobs against a tiny random Wan 2.1 folder (``omni-model-wan``'s own test builder)."""

from __future__ import annotations

import os
import time
import warnings

import pytest

pytest.importorskip("omni_model_wan", reason="the video tests use the Wan model plugin (omni-model-wan)")
pytest.importorskip("imageio_ffmpeg", reason="MP4 writing needs imageio-ffmpeg")

QUICK = {"prompt": "a cat walking", "size": "16x16", "num_frames": 5, "num_inference_steps": 2, "seed": 0}


@pytest.fixture(scope="session")
def wan_model(tmp_path_factory) -> str:
    from omni_model_wan.testing import build_tiny_wan

    return build_tiny_wan(tmp_path_factory.mktemp("tiny-wan"))


@pytest.fixture(scope="module")
def video_server(wan_model, start_server, tmp_path_factory):
    # no warmup: the start-up warmup runs the model's default 832x480x81 size, far too big for a tiny test
    return start_server(wan_model, {"streaming_output": True, "warmup": False, "max_num_seqs": 2,
                                    "limits": {"max_steps": 1000}},  # jobs held running by 1000 steps
                        served_model_name="tiny-wan", max_video_jobs=3,
                        video_dir=str(tmp_path_factory.mktemp("videos")))


def poll(client, job_id: str, until=("completed", "failed", "cancelled"), timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        job = client.get(f"/v1/videos/{job_id}").json()
        if job["status"] in until:
            return job
        assert time.monotonic() < deadline, f"job {job_id} stuck in {job['status']}"
        time.sleep(0.05)


def mp4_frames(data: bytes, tmp_path) -> list:
    import imageio.v2 as imageio

    path = tmp_path / "v.mp4"
    path.write_bytes(data)
    with imageio.get_reader(str(path)) as reader:
        return [frame for frame in reader]


def test_video_job_lifecycle(video_server, tmp_path, wait_idle):
    with video_server.client() as c:
        created = c.post("/v1/videos", json={**QUICK, "model": "tiny-wan", "fps": 8})
        assert created.status_code == 200, created.text
        job = created.json()
        assert job["object"] == "video" and job["id"].startswith("video_") and job["status"] in ("queued", "in_progress")
        assert job["size"] == "16x16" and job["num_frames"] == 5 and job["seconds"] == "0.625" and job["model"] == "tiny-wan"
        done = poll(c, job["id"])
        assert done["status"] == "completed" and done["progress"] == 100 and done["error"] is None
        assert done["expires_at"] > done["completed_at"] >= done["created_at"]
        listed = c.get("/v1/videos").json()
        assert job["id"] in [j["id"] for j in listed["data"]]
        content = c.get(f"/v1/videos/{job['id']}/content")
        assert content.status_code == 200 and content.headers["content-type"] == "video/mp4"
        assert content.content[4:8] == b"ftyp"
        frames = mp4_frames(content.content, tmp_path)
        assert len(frames) == 5 and frames[0].shape == (16, 16, 3)
        path = os.path.join(video_server.app.state.omni.videos.directory, f"{job['id']}.mp4")
        assert os.path.isfile(path)
        deleted = c.delete(f"/v1/videos/{job['id']}").json()
        assert deleted == {"id": job["id"], "object": "video.deleted", "deleted": True, "status": "completed"}
        assert not os.path.exists(path)
        assert c.get(f"/v1/videos/{job['id']}").status_code == 404
        gone = c.get(f"/v1/videos/{job['id']}/content")
        assert gone.status_code == 404 and gone.json()["error"]["param"] == "video_id"
    assert wait_idle(video_server.engine)["tracked_requests"] == []


def test_same_seed_same_video(video_server, tmp_path):
    with video_server.client() as c:
        ids = [c.post("/v1/videos", json=QUICK).json()["id"] for _ in range(2)]
        blobs = []
        for job_id in ids:
            assert poll(c, job_id)["status"] == "completed"
            blobs.append(c.get(f"/v1/videos/{job_id}/content").content)
            c.delete(f"/v1/videos/{job_id}")
    import numpy as np

    a, b = (np.stack(mp4_frames(blob, tmp_path)) for blob in blobs)
    assert np.array_equal(a, b)


def test_deleting_a_running_job_aborts_its_request(video_server, wait_idle):
    engine = video_server.engine
    before = engine.stats()
    with video_server.client() as c:
        job = c.post("/v1/videos", json={**QUICK, "num_inference_steps": 1000}).json()
        running = poll(c, job["id"], until=("in_progress",))
        assert 0 <= running["progress"] < 100
        deleted = c.delete(f"/v1/videos/{job['id']}").json()
        assert deleted["deleted"] is True and deleted["status"] == "cancelled"
        assert c.get(f"/v1/videos/{job['id']}").status_code == 404
    stats = wait_idle(engine)
    assert stats["tracked_requests"] == [] and stats["requests_aborted"] == before["requests_aborted"] + 1
    assert os.listdir(video_server.app.state.omni.videos.directory) == []


def test_content_before_completion_is_409(video_server, wait_idle):
    with video_server.client() as c:
        job = c.post("/v1/videos", json={**QUICK, "num_inference_steps": 1000}).json()
        r = c.get(f"/v1/videos/{job['id']}/content")
        assert r.status_code == 409 and r.json()["error"]["code"] == "video_not_ready"
        bad = c.get(f"/v1/videos/{job['id']}/content", params={"variant": "thumbnail"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "variant"
        c.delete(f"/v1/videos/{job['id']}")
    wait_idle(video_server.engine)


def test_job_table_is_bounded_and_expires(video_server, wait_idle):
    jobs = video_server.app.state.omni.videos
    with video_server.client() as c:
        slow = [c.post("/v1/videos", json={**QUICK, "num_inference_steps": 1000}).json()["id"] for _ in range(3)]
        full = c.post("/v1/videos", json=QUICK)
        assert full.status_code == 429 and full.json()["error"]["code"] == "too_many_video_jobs"
        assert "retry-after" in full.headers
        for job_id in slow:
            c.delete(f"/v1/videos/{job_id}")
        wait_idle(video_server.engine)
        done = [c.post("/v1/videos", json=QUICK).json()["id"] for _ in range(3)]
        for job_id in done:
            poll(c, job_id)
        newest = c.post("/v1/videos", json=QUICK).json()["id"]  # evicts the oldest finished job
        assert c.get(f"/v1/videos/{done[0]}").status_code == 404
        assert not os.path.exists(jobs.path_for(done[0]))
        finished = poll(c, newest)
        assert finished["status"] == "completed"
        assert jobs.sweep(now=finished["expires_at"] + 1) == 3  # every finished job expired
        assert c.get(f"/v1/videos/{newest}").status_code == 404
        assert os.listdir(jobs.directory) == []


@pytest.mark.parametrize("body, status, param", [
    ({**QUICK, "size": "20x16"}, 400, "size"),
    ({**QUICK, "num_frames": 0}, 400, "num_frames"),  # 6 is rounded to 5 (diffusers), 0 is nonsense
    ({**QUICK, "true_cfg_scale": 2.0}, 400, "true_cfg_scale"),
    ({**QUICK, "seconds": "4"}, 400, "seconds"),  # seconds and num_frames together
    ({**QUICK, "model": "sora-2"}, 404, "model"),
])
def test_invalid_video_requests(video_server, body, status, param):
    with video_server.client() as c:
        r = c.post("/v1/videos", json=body)
    assert r.status_code == status and r.json()["error"]["param"] == param, r.text


def test_image_endpoint_on_a_video_model_and_video_endpoint_on_an_image_model(video_server, server):
    with video_server.client() as c:
        r = c.post("/v1/images/generations", json={"prompt": "x"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "model"
        assert c.get("/v1/models").json()["data"][0]["modality"] == "video"
    with server.client() as c:
        r = c.post("/v1/videos", json={"prompt": "x"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "model"
        assert "makes images" in r.json()["error"]["message"]


def test_openai_client_video_jobs(video_server, tmp_path):
    """The official client sends multipart/form-data to /v1/videos; retrieve, download and delete work too."""
    import openai

    client = openai.OpenAI(base_url=f"{video_server.url}/v1", api_key="test-key", max_retries=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the client marks its Sora API deprecated
        video = client.videos.create(prompt="a dog running", model="tiny-wan", seconds="1", size="16x16",
                                     extra_body={"fps": 8, "num_inference_steps": 2, "seed": 1})
        assert video.status in ("queued", "in_progress") and video.seconds == "1" and video.size == "16x16"
        while video.status in ("queued", "in_progress"):
            time.sleep(0.05)
            video = client.videos.retrieve(video.id)
        assert video.status == "completed" and video.progress == 100
        data = client.videos.download_content(video.id).read()
        frames = mp4_frames(data, tmp_path)
        assert len(frames) == 9  # 1 s at 8 fps, rounded to Wan's 4k+1 frames
        assert client.videos.delete(video.id).deleted is True
        with pytest.raises(openai.NotFoundError):
            client.videos.retrieve(video.id)
        with pytest.raises(openai.BadRequestError) as info:
            client.videos.create(prompt="x", seconds="1", size="17x16")
        assert info.value.body["param"] == "size"


def test_vllm_omni_video_client_shapes(video_server, tmp_path):
    """vLLM-Omni's benchmark ``/v1/videos`` backend: a url-encoded form (aiohttp's FormData without files) with
    separate ``width``/``height``, polled until completed or failed, then the content, then a DELETE; the job
    carries the peak memory its client reads."""
    form = {"prompt": "Random prompt 0 for benchmarking diffusion models", "height": "16", "width": "16",
            "num_frames": "5", "num_inference_steps": "2", "seed": "42", "fps": "8",
            "negative_prompt": "Negative prompt 0 for benchmarking diffusion models", "model": "default"}
    with video_server.client() as c:
        created = c.post("/v1/videos", data=form)  # httpx encodes a dict without files as url-encoded
        assert created.request.headers["content-type"] == "application/x-www-form-urlencoded"
        assert created.status_code == 200, created.text
        job = created.json()
        assert job["size"] == "16x16" and job["num_frames"] == 5 and job["fps"] == 8
        done = poll(c, job["id"], until=("completed", "failed"))
        assert done["status"] == "completed" and done["peak_memory_mb"] > 0
        content = c.get(f"/v1/videos/{job['id']}/content")
        assert content.status_code == 200 and len(mp4_frames(content.content, tmp_path)) == 5
        assert c.delete(f"/v1/videos/{job['id']}").status_code == 200


@pytest.mark.parametrize("form, param", [
    ({"prompt": "x", "width": "16"}, "height"),
    ({"prompt": "x", "width": "16", "height": "16", "size": "16x16"}, "size"),
    ({"prompt": "x", "width": "sixteen", "height": "16"}, "width"),
    ({"prompt": "x", "prompt2": "y"}, "prompt2"),
])
def test_bad_form_video_requests(video_server, form, param):
    with video_server.client() as c:
        r = c.post("/v1/videos", data=form)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_text_to_video_model_refuses_an_input_reference(video_server):
    import base64

    with video_server.client() as c:
        r = c.post("/v1/videos", data={**{k: str(v) for k, v in QUICK.items()}},
                   files={"input_reference": ("in.png", b"\x89PNG...", "image/png")})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input_reference", r.text
        assert "takes no input image" in r.json()["error"]["message"]
        url = "data:image/png;base64," + base64.b64encode(b"x").decode()
        r = c.post("/v1/videos", json={**QUICK, "input_reference": url})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input_reference"


def test_a_cancelled_job_ends_a_client_polling_for_completed_or_failed(video_server, wait_idle):
    """A job whose request was aborted (not deleted) reads ``failed`` with error code ``cancelled``: OpenAI's video
    statuses have no ``cancelled``, and clients that poll for completed/failed would wait forever."""
    jobs = video_server.app.state.omni.videos
    with video_server.client() as c:
        job = c.post("/v1/videos", json={**QUICK, "num_inference_steps": 1000}).json()
        poll(c, job["id"], until=("in_progress",))
        video_server.engine.abort(jobs.get(job["id"]).request_id)
        ended = poll(c, job["id"], until=("completed", "failed"))
        assert ended["status"] == "failed" and ended["error"]["code"] == "cancelled"
        c.delete(f"/v1/videos/{job['id']}")
    wait_idle(video_server.engine)


@pytest.fixture(scope="module")
def i2v_server(start_server, tmp_path_factory):
    from omni_model_wan.testing import build_tiny_wan_i2v

    folder = build_tiny_wan_i2v(tmp_path_factory.mktemp("tiny-wan-i2v"), wan22=True)
    return start_server(folder, {"streaming_output": True, "warmup": False, "max_num_seqs": 2},
                        served_model_name="tiny-wan-i2v", video_dir=str(tmp_path_factory.mktemp("i2v-videos")))


def test_image_to_video_jobs_take_input_reference(i2v_server, tmp_path, monkeypatch):
    """The image reaches the engine as the uploaded pixels, as a multipart file part (the openai client's form) or
    as a data URL in JSON, and both give the same video; a job without the image is a 400 naming input_reference.
    (The tiny VAE maps different inputs to nearly the same frames; the plugin's tests check the image's effect on
    the latents.)"""
    import base64
    import io

    import numpy as np
    from PIL import Image

    picture = np.random.default_rng(1).integers(0, 256, (24, 20, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(picture).save(buf, "PNG")
    png = buf.getvalue()
    engine = i2v_server.engine
    received = []
    submit = engine.submit

    def spy(requests, **kwargs):  # the real submit runs; this only records what it was given
        handles = submit(requests, **kwargs)
        received.extend(h.request.images for h in handles)
        return handles

    monkeypatch.setattr(engine, "submit", spy)
    fields = {k: str(v) for k, v in QUICK.items()}
    with i2v_server.client() as c:
        jobs = [c.post("/v1/videos", data=fields, files={"input_reference": ("in.png", png, "image/png")}),
                c.post("/v1/videos", json={**QUICK, "input_reference": "data:image/png;base64,"
                                           + base64.b64encode(png).decode()})]
        assert all(r.status_code == 200 for r in jobs), [r.text for r in jobs]
        videos = []
        for r in jobs:
            assert poll(c, r.json()["id"], until=("completed", "failed"))["status"] == "completed"
            videos.append(np.stack(mp4_frames(c.get(f"/v1/videos/{r.json()['id']}/content").content, tmp_path)))
        assert np.array_equal(videos[0], videos[1]), "a file part and a data URL are the same input"
        assert len(received) == 2
        for (image,) in received:  # the checked uint8 tensor [3, H, W] holds exactly the uploaded pixels
            assert np.array_equal(image.permute(1, 2, 0).numpy(), picture)
        missing = c.post("/v1/videos", json=QUICK)
        assert missing.status_code == 400 and missing.json()["error"]["param"] == "input_reference", missing.text

"""``POST /v1/images/edits`` and ``POST /v1/chat/completions`` against live servers: the official ``openai``
client edits an image, bad uploads are 400s naming the field, and vLLM-Omni's clients' request shapes work.
The edit model is the test-only ``TinyEditTestPipeline`` (it blends its input images into the start)."""

from __future__ import annotations

import base64
import io
import warnings

import numpy as np
import pytest

API_KEY = "test-key"  # the shared servers' key (conftest.py)

QUICK = {"size": "16x16", "num_inference_steps": 2, "seed": 3}


def png(width: int = 24, height: int = 20, seed: int = 0, fmt: str = "PNG") -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, format=fmt)
    return buf.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()



@pytest.fixture(scope="module")
def edit_server(edit_model, start_server):
    return start_server(edit_model, {"streaming_output": True, "max_num_seqs": 4,
                                     "limits": {"max_image_pixels": 256 * 256}}, served_model_name="tiny-edit")


def openai_client(live):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key=API_KEY, max_retries=0)


def test_openai_client_edits_an_image_and_gets_n_images(edit_server, decode_png):
    client = openai_client(edit_server)
    result = client.images.edit(model="tiny-edit", image=("in.png", png(seed=1), "image/png"), prompt="make it red",
                                n=2, size="16x16", extra_body={"num_inference_steps": 2, "seed": 3})
    assert len(result.data) == 2
    first = decode_png(result.data[0].b64_json)
    assert first.shape == (16, 16, 3)
    other = client.images.edit(image=("in.png", png(seed=2), "image/png"), prompt="make it red", size="16x16",
                               extra_body={"num_inference_steps": 2, "seed": 3})
    assert np.abs(first.astype(int) - decode_png(other.data[0].b64_json).astype(int)).max() > 10, \
        "the uploaded image must be what the model edits"


def test_several_images_as_image_array(edit_server):
    client = openai_client(edit_server)
    result = client.images.edit(image=[("a.png", png(seed=1), "image/png"), ("b.jpg", png(seed=2, fmt="JPEG"),
                                                                              "image/jpeg")],
                                prompt="blend them", size="16x16", extra_body={"num_inference_steps": 2})
    assert len(result.data) == 1


def post_edit(live, files, **fields):
    with live.client() as http:
        return http.post("/v1/images/edits", files=files, data={"prompt": "edit", **QUICK, **fields})


@pytest.mark.parametrize("files, param, words", [
    ([("image", ("x.png", b"not an image", "image/png"))], "image", "is not an image file"),
    ([("image", ("x.png", png(300, 300), "image/png"))], "image", "exceeds max_image_pixels=65536"),
    ([("image[]", ("a.png", png(), "image/png"))] * 3, "image", "takes 1 to 2 input image(s) in 'image', got 3"),
    ([], "image", "takes 1 to 2 input image(s) in 'image', got 0"),
    ([("image", ("x.png", png()[:60], "image/png"))], "image", "could not be decoded"),
    ([("image", ("x.png", png(), "image/png")), ("mask", ("m.png", png(), "image/png"))], "mask",
     "'mask' is not supported"),
    ([("picture", ("x.png", png(), "image/png"))], "picture", "unexpected file field 'picture'"),
], ids=["not-an-image", "too-large", "too-many", "none", "truncated", "mask", "unknown-file"])
def test_bad_uploads_are_400_naming_the_field(edit_server, files, param, words):
    r = post_edit(edit_server, files)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


@pytest.mark.parametrize("data", [png(300, 300), png(300, 300)[:120]], ids=["whole", "header-only"])
def test_an_upload_over_max_image_pixels_is_refused_from_its_header(edit_server, data):
    """The declared size is checked before the pixels are decoded: a file whose header declares 300x300 is refused
    as too large even when its pixel data is missing (decoding it would fail differently, or cost memory)."""
    r = post_edit(edit_server, [("image", ("x.png", data, "image/png"))])
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "image" and err["code"] == "image_too_large", err
    assert "300x300 = 90000 pixels, which exceeds max_image_pixels=65536" in err["message"], err


def test_a_text_field_where_a_file_belongs(edit_server):
    r = post_edit(edit_server, [("dummy", ("d.txt", b"x", "text/plain"))], image="not-a-file")
    assert r.status_code == 400 and r.json()["error"]["param"] == "image"


def test_an_upload_larger_than_max_body_but_under_the_upload_cap(edit_model, start_server):
    live = start_server(edit_model, {"max_num_seqs": 1, "warmup": False}, max_body_bytes=1000)
    big = png(200, 200, seed=4)  # ~120 kB of noise: over max_body_bytes, under max_upload_bytes
    assert len(big) > 1000
    r = post_edit(live, [("image", ("big.png", big, "image/png"))])
    assert r.status_code == 200, r.text
    with live.client() as http:
        r = http.post("/v1/images/generations", json={"prompt": "x" * 2000})
    assert r.status_code == 413 and "max_body_bytes=1000" in r.json()["error"]["message"]


def test_streamed_edit_with_step_previews_sends_a_preview_per_step_named_as_openai_names_edit_events(edit_server):
    with edit_server.client() as http:
        r = http.post("/v1/images/edits", files=[("image", ("x.png", png(), "image/png"))],
                      data={"prompt": "edit", "stream": "true", "step_previews": "true", "size": "16x16",
                            "num_inference_steps": "3"})
    assert r.status_code == 200
    events = [line for line in r.text.splitlines() if line.startswith("event:")]
    assert events == ["event: image_edit.partial_image"] * 3 + ["event: image_edit.completed"]


def test_a_text_model_refuses_edits_naming_image(server):
    r = post_edit(server, [("image", ("x.png", png(), "image/png"))])
    assert r.status_code == 400 and r.json()["error"]["param"] == "image"
    assert "does not edit images" in r.json()["error"]["message"]


# ------------------------------------------------------------------ chat completions (vLLM-Omni's image route)
def chat(live, body):
    with live.client() as http:
        return http.post("/v1/chat/completions", json=body)


def chat_images(reply, decode_png) -> list:
    (choice,) = reply["choices"]
    parts = choice["message"]["content"]
    assert all(p["type"] == "image_url" for p in parts)
    return [decode_png(p["image_url"]["url"].split(",", 1)[1]) for p in parts]


def test_chat_completions_make_an_image_with_extra_body(server, decode_png):
    r = chat(server, {"model": "default", "messages": [{"role": "user", "content": "a red circle"}],
                      "extra_body": {"height": 16, "width": 24, "num_inference_steps": 2, "seed": 1, "fps": 24}})
    assert r.status_code == 200, r.text
    reply = r.json()
    (image,) = chat_images(reply, decode_png)
    assert image.shape == (16, 24, 3)
    assert reply["usage"]["peak_memory_mb"] > 0 and reply["metrics"]["peak_memory_mb"] > 0
    # the same request through the images route gives the same pixels
    with server.client() as http:
        same = http.post("/v1/images/generations", json={"prompt": "a red circle", "size": "24x16",
                                                         "num_inference_steps": 2, "seed": 1}).json()
    assert np.array_equal(image, np.asarray(__import__("PIL.Image", fromlist=["Image"]).open(
        io.BytesIO(base64.b64decode(same["data"][0]["b64_json"]))).convert("RGB")))
    assert same["usage"]["peak_memory_mb"] > 0


def test_chat_completions_edit_with_a_data_url(edit_server, decode_png):
    content = [{"type": "text", "text": "make it red"}, {"type": "image_url", "image_url": {"url": data_url(png())}}]
    r = chat(edit_server, {"model": "tiny-edit", "messages": [{"role": "user", "content": content}],
                           "height": 16, "width": 16, "num_inference_steps": 2})
    assert r.status_code == 200, r.text
    assert chat_images(r.json(), decode_png)[0].shape == (16, 16, 3)


@pytest.mark.parametrize("body, param, words", [
    ({"messages": []}, "messages", "'messages' is required"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages", "no message with role 'user'"),
    ({"messages": [{"role": "user", "content": [{"type": "audio"}]}]}, "messages", "content part 0"),
    ({"messages": [{"role": "user", "content": "x"}], "extra_body": {"steps": 2}}, "steps",
     "unrecognized request argument 'steps'"),
    ({"messages": [{"role": "user", "content": "x"}], "seed": 1, "extra_body": {"seed": 2}}, "seed", "give it once"),
    ({"messages": [{"role": "user", "content": "x"}], "stream": True}, "stream", "not supported"),
    ({"model": "other", "messages": [{"role": "user", "content": "x"}]}, "model", "does not exist"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "image_url",
      "image_url": {"url": "https://example.com/a.png"}}]}]}, "messages", "does not take input images"),
], ids=["empty", "no-user", "bad-part", "unknown-field", "twice", "stream", "model", "image-on-text-model"])
def test_bad_chat_requests_are_400_naming_the_field(server, body, param, words):
    r = chat(server, body)
    assert r.status_code in (400, 404), r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_a_remote_image_url_is_refused(edit_server):
    content = [{"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]
    r = chat(edit_server, {"messages": [{"role": "user", "content": content}]})
    assert r.status_code == 400 and "does not fetch remote URLs" in r.json()["error"]["message"]


def test_vllm_omni_benchmark_image_requests_all_complete(server):
    """What vLLM-Omni's ``diffusion_benchmark_serving.py`` sends with its defaults (``--dataset random --task t2i``,
    endpoint /v1/chat/completions, model ``default``, 50 steps, concurrency 1), after one 2-step warm-up: 100 of
    100 complete, each reply holding an image and the peak memory its client reads."""
    import httpx

    def request(i: int, steps: int) -> dict:
        return {"model": "default", "messages": [{"role": "user",
                                                  "content": f"Random prompt {i} for benchmarking diffusion models"}],
                "extra_body": {"num_inference_steps": steps, "seed": 42}}

    ok = 0
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as http:
        assert http.post("/v1/chat/completions", json=request(0, 2)).status_code == 200  # its warm-up
        for i in range(100):
            r = http.post("/v1/chat/completions", json=request(i, 50))
            reply = r.json() if r.status_code == 200 else {}
            parts = (reply.get("choices") or [{}])[0].get("message", {}).get("content") or []
            if r.status_code == 200 and parts and parts[0].get("peak_memory_mb", 0) > 0:
                ok += 1
    assert ok == 100


def test_openapi_documents_the_new_routes(edit_server):
    with edit_server.client() as http:
        schema = http.get("/openapi.json").json()
    edits = schema["paths"]["/v1/images/edits"]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"]
    assert {"image", "image[]", "mask", "prompt"} <= set(edits["properties"])
    assert "/v1/chat/completions" in schema["paths"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        videos = schema["paths"]["/v1/videos"]["post"]["requestBody"]["content"]
    assert "application/x-www-form-urlencoded" in videos


def test_openai_client_edits_with_a_tiny_qwen_image_edit(start_server, tmp_path_factory, decode_png):
    """The bar of the issue with a real model: ``client.images.edit`` against ``omni serve``'s app with a tiny
    random Qwen-Image-Edit folder (start-up warm-up included: it edits a grey image) gets the n images it asks for;
    a model-level refusal (a size the model cannot make) is a 400 naming the field."""
    pytest.importorskip("omni_model_qwen_image")
    from omni_model_qwen_image.testing import build_tiny_qwen_image_edit

    folder = build_tiny_qwen_image_edit(tmp_path_factory.mktemp("tiny-qwen-edit"))
    live = start_server(folder, {"streaming_output": True, "max_num_seqs": 2}, served_model_name="qwen-edit")
    client = openai_client(live)
    result = client.images.edit(model="qwen-edit", image=("cat.png", png(40, 30, seed=5), "image/png"),
                                prompt="make the cat red", n=2, size="64x64",
                                extra_body={"num_inference_steps": 2, "seed": 1, "negative_prompt": "blurry"})
    assert len(result.data) == 2 and decode_png(result.data[0].b64_json).shape == (64, 64, 3)
    r = post_edit(live, [("image", ("x.png", png(), "image/png"))], size="40x40")
    assert r.status_code == 400 and r.json()["error"]["param"] == "size", r.text

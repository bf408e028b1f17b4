"""OpenAI's image streaming protocol, driven by the official ``openai`` client (issue #37): ``partial_images`` 0-3
previews spread over the steps, then one completed event per image; ``image_generation.*`` events on generations,
``image_edit.*`` on edits; ``n > 1``; omni's ``step_previews`` extension (a preview per step)."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest

from tests.serve.conftest import API_KEY

openai = pytest.importorskip("openai")


def png(width: int = 24, height: int = 20, seed: int = 0) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def pixels(b64: str) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


def client_of(live):
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def edit_server(edit_model, start_server):
    return start_server(edit_model, {"streaming_output": True, "max_num_seqs": 4}, served_model_name="tiny-edit")


@pytest.mark.parametrize("n", [1, 2])
def test_generate_stream_with_partial_images_2_yields_2_partials_then_the_images(server, n):
    client = client_of(server)
    extra = {"seed": 3, "num_inference_steps": 6}
    events = list(client.images.generate(model="default", prompt="a red circle", size="32x32", n=n, stream=True,
                                         partial_images=2, extra_body=extra))
    assert [type(e).__name__ for e in events] == ["ImageGenPartialImageEvent"] * 2 + ["ImageGenCompletedEvent"] * n
    assert [e.type for e in events] == ["image_generation.partial_image"] * 2 + ["image_generation.completed"] * n
    partial, done = events[:2], events[2:]
    assert [e.partial_image_index for e in partial] == [0, 1]
    assert [e.step for e in partial] == [2, 4]  # spread over the 6 steps (our extra field); the image after step 6
    assert all(e.size == "32x32" and e.output_format == "png" and e.created_at > 0 for e in events)
    assert [e.index for e in done] == list(range(n)) and done[0].usage.total_tokens == 0
    plain = client.images.generate(model="default", prompt="a red circle", size="32x32", n=n, extra_body=extra)
    for e, d in zip(done, plain.data):  # the same images as without streaming
        assert np.array_equal(pixels(e.b64_json), pixels(d.b64_json))


@pytest.mark.parametrize("partial, steps, expected", [(0, 4, []), (1, 4, [2]), (3, 8, [2, 4, 6]), (3, 2, [1])])
def test_partial_images_spread_over_the_steps(server, partial, steps, expected):
    events = list(client_of(server).images.generate(
        model="default", prompt="p", size="16x16", stream=True, partial_images=partial,
        extra_body={"seed": 1, "num_inference_steps": steps}))
    assert [e.step for e in events if e.type == "image_generation.partial_image"] == expected
    assert [e.type for e in events][len(expected):] == ["image_generation.completed"]


def test_stream_without_partial_images_is_one_completed_event_as_openai_defaults(server):
    events = list(client_of(server).images.generate(model="default", prompt="p", size="16x16", stream=True,
                                                    extra_body={"num_inference_steps": 3}))
    assert [e.type for e in events] == ["image_generation.completed"]


def test_step_previews_is_omnis_extension_a_preview_per_step(server):
    events = list(client_of(server).images.generate(model="default", prompt="p", size="16x16", stream=True,
                                                    extra_body={"num_inference_steps": 4, "step_previews": True}))
    assert [e.type for e in events] == ["image_generation.partial_image"] * 4 + ["image_generation.completed"]
    assert [(e.partial_image_index, e.step, e.num_steps) for e in events[:4]] == [(i, i + 1, 4) for i in range(4)]


@pytest.mark.parametrize("n", [1, 2])
def test_edit_stream_yields_image_edit_events_and_the_images(edit_server, n):
    client = client_of(edit_server)
    extra = {"seed": 2, "num_inference_steps": 3}
    events = list(client.images.edit(model="tiny-edit", image=("in.png", png(), "image/png"), prompt="make it red",
                                     size="16x16", n=n, stream=True, partial_images=2, extra_body=extra))
    assert [type(e).__name__ for e in events] == ["ImageEditPartialImageEvent"] * 2 + ["ImageEditCompletedEvent"] * n
    assert [e.type for e in events] == ["image_edit.partial_image"] * 2 + ["image_edit.completed"] * n
    plain = client.images.edit(model="tiny-edit", image=("in.png", png(), "image/png"), prompt="make it red",
                               size="16x16", n=n, extra_body=extra)
    assert [e.index for e in events[2:]] == list(range(n))
    for e, d in zip(events[2:], plain.data):
        assert np.array_equal(pixels(e.b64_json), pixels(d.b64_json))
    # and without partial_images: the image in one event each, as OpenAI sends it
    only = list(client.images.edit(model="tiny-edit", image=("in.png", png(), "image/png"), prompt="make it red",
                                   size="16x16", stream=True, extra_body=extra))
    assert [e.type for e in only] == ["image_edit.completed"]


@pytest.mark.parametrize("kwargs, message", [
    ({"partial_images": 4, "stream": True}, "allowed values are 0, 1, 2, 3"),
    ({"partial_images": -1}, "allowed values are 0, 1, 2, 3"),
    ({"partial_images": 2, "stream": True, "extra_body": {"step_previews": True}}, "not both"),
])
def test_bad_partial_images_is_a_400_naming_it(server, kwargs, message):
    with pytest.raises(openai.BadRequestError) as info:
        client_of(server).images.generate(model="default", prompt="p", size="16x16", **kwargs)
    assert message in info.value.body["message"]
    assert info.value.body["param"] in ("partial_images", "step_previews")


def test_partial_images_without_stream_is_accepted_and_changes_nothing(server):
    client = client_of(server)
    a = client.images.generate(model="default", prompt="p", size="16x16", partial_images=2, extra_body={"seed": 4})
    b = client.images.generate(model="default", prompt="p", size="16x16", extra_body={"seed": 4})
    assert np.array_equal(pixels(a.data[0].b64_json), pixels(b.data[0].b64_json))


def test_partial_images_with_the_models_default_step_count(server):
    """No ``num_inference_steps`` in the request: the previews spread over the model's own count."""
    from omni_core.request import preview_steps

    events = list(client_of(server).images.generate(model="default", prompt="p", size="16x16", stream=True,
                                                    partial_images=2, extra_body={"seed": 1}))
    partial = [e for e in events if e.type == "image_generation.partial_image"]
    assert len(partial) == 2 and [e.step for e in partial] == sorted(preview_steps(2, partial[0].num_steps))
    assert events[-1].type == "image_generation.completed"

"""``omni serve`` on a diffusers folder no native plugin needs, for real (a subprocess), with the OpenAI client: an
image family gives diffusers' own pixels, takes the call's parameters as ``extra_args`` and streams partial images;
a video family (forced with ``--pipeline diffusers``) makes a video job."""

from __future__ import annotations

import base64
import io
import time
import warnings

import numpy as np
import pytest

from omni_model_diffusers.parity import reference, reference_call
from omni_model_diffusers.testing import FAMILIES


def test_openai_client_image_through_the_diffusers_backend(family):
    import openai
    from PIL import Image

    from omni_core.images import unit_float_to_pil
    from omni_core.testing.serve_process import ServeProcess

    path = family("sd")
    body = {"num_inference_steps": 2, "guidance_scale": 5.0, "seed": 7, "extra_args": {"guidance_rescale": 0.7}}
    with ServeProcess(path, "--no-warmup", "--cpu-threads", "1") as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0)
        got = client.images.generate(prompt="a cat", size="32x32", response_format="b64_json", extra_body=body)
        events = list(client.images.generate(prompt="a cat", size="32x32", stream=True, partial_images=2,
                                             extra_body={**body, "num_inference_steps": 4}))
        with pytest.raises(openai.BadRequestError) as info:
            client.images.generate(prompt="a cat", size="32x32", extra_body={"extra_args": {"strenght": 0.5}})
    pixels = np.asarray(Image.open(io.BytesIO(base64.b64decode(got.data[0].b64_json))).convert("RGB"))
    ref = reference_call(reference(path), FAMILIES["sd"], ["a cat"], [7], guidance_rescale=0.7)[0]
    assert np.array_equal(pixels, np.asarray(unit_float_to_pil(ref)))
    assert info.value.body["param"] == "extra_args" and "'strenght'" in info.value.body["message"]
    # previews stream from the pipeline's own loop (request mode): two partial images, then the image
    assert [e.type for e in events] == ["image_generation.partial_image"] * 2 + ["image_generation.completed"]


def test_openai_client_video_job_through_the_diffusers_backend(family, tmp_path):
    import imageio.v2 as imageio
    import openai

    from omni_core.testing.serve_process import ServeProcess

    with ServeProcess(family("wan"), "--pipeline", "diffusers", "--no-warmup", "--cpu-threads", "1") as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # the client marks its Sora API deprecated
            video = client.videos.create(prompt="a dog running", seconds="1", size="16x16",
                                         extra_body={"fps": 8, "num_inference_steps": 2, "seed": 1,
                                                     "max_sequence_length": 16})
            deadline = time.monotonic() + 120
            while video.status in ("queued", "in_progress") and time.monotonic() < deadline:
                time.sleep(0.05)
                video = client.videos.retrieve(video.id)
            assert video.status == "completed", video
            data = client.videos.download_content(video.id).read()
    (tmp_path / "v.mp4").write_bytes(data)
    with imageio.get_reader(str(tmp_path / "v.mp4")) as reader:
        frames = [frame for frame in reader]  # list() asks len(), which is inf for a stream
    assert len(frames) == 9 and frames[0].shape[:2] == (16, 16)  # 1 s at 8 fps, rounded to Wan's 4k+1 frames

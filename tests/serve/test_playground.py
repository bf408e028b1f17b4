"""The playground page (``/``, ``/playground``) of a real ``omni serve shapes --api-key``: served without the
key, self-contained (no CDN), and driven in a real headless Chromium (the system's, through playwright; nothing
is downloaded): live previews then a result the shapes judge reads as the prompt, the 401 message, Stop within
a step, the server's own error text.

One server and one browser for the module. Set ``OMNI_PLAYGROUND_SCREENSHOT=docs/images/playground.png`` to
refresh the README's screenshot (taken after two generations)."""

from __future__ import annotations

import base64
import io
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

#: its tests share one server and one browser (module fixtures): on one xdist worker, not started on both
pytestmark = pytest.mark.xdist_group("serve-playground")

pytest.importorskip("omni_model_shapes", reason="the shapes demo model (omni-model-shapes) is not installed")

KEY = "playground-secret"
TESTIDS = ("prompt", "generate", "stop", "preview", "result", "progress", "error", "history")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_browser = pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary on PATH (scripts/install.sh installs "
                                                            "Debian's chromium package with apt-get)")


@pytest.fixture(scope="module")
def url():
    """``omni serve shapes --api-key KEY`` in a subprocess, on a free port."""
    script = Path(sys.executable).parent / "omni"
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "omni_core.cli"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNI_") or k == "OMNI_STRICT_PLUGINS"}
    proc = subprocess.Popen([*cmd, "serve", "shapes", "--port", "0", "--api-key", KEY, "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    import torch  # noqa: F401 - the judge's; imported while the server starts (seconds on a loaded machine)

    deadline, found = time.monotonic() + 120, None
    while found is None and time.monotonic() < deadline and proc.poll() is None:
        if select.select([proc.stdout], [], [], 0.5)[0]:
            found = re.search(r"on (http://\S+) ", proc.stdout.readline())
    if found is None:
        proc.kill()
        raise AssertionError(f"omni serve shapes did not start: {proc.stderr.read()}")
    yield found.group(1)
    proc.send_signal(signal.SIGTERM)
    try:
        assert proc.wait(30) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()


def api(url: str, method: str, path: str, **kwargs) -> httpx.Response:
    return httpx.request(method, url + path, headers={"Authorization": f"Bearer {KEY}"}, timeout=60, **kwargs)


def metric(url: str, name: str, labels: str = "") -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return float(re.search(rf"^{name}\{{[^}}]*{labels}[^}}]*\}} (\S+)$", text, re.M).group(1))


# ------------------------------------------------------------------------------------------ plain HTTP
def test_the_page_and_its_files_are_served_without_the_key(url):
    for path in ("/", "/playground"):
        page = httpx.get(url + path)
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        for testid in TESTIDS:
            assert f'data-testid="{testid}"' in page.text, testid
        assert re.search(r'<img id="preview" data-testid="preview"', page.text)
        assert re.search(r'<img id="result" data-testid="result"', page.text)
    assert httpx.head(url + "/").status_code == 200
    script, style = httpx.get(url + "/playground/app.js"), httpx.get(url + "/playground/style.css")
    assert script.status_code == 200 and script.headers["content-type"].startswith("text/javascript")
    assert style.status_code == 200 and style.headers["content-type"].startswith("text/css")
    for text in (page.text, script.text, style.text):  # no CDN, no remote font: the page works offline
        assert not re.search(r"https?://|//cdn|@import", text)
    # the page is public, the API is not; the page's files are served by name only
    assert httpx.get(url + "/v1/models").status_code == 401
    assert httpx.get(url + "/playground/routes.py").status_code == 401
    assert api(url, "GET", "/playground/../routes/playground.py").status_code == 404
    assert "/playground" not in api(url, "GET", "/openapi.json").json()["paths"]


def test_models_tell_the_page_what_the_model_takes(url):
    (model,) = api(url, "GET", "/v1/models").json()["data"]
    assert model["id"] == "shapes" and model["modality"] == "image" and model["streaming_previews"] is True
    assert model["size_multiple"] == 4 and model["image_input"] is None and model["frame_multiple"] is None
    assert model["limits"]["max_pixels"] == 64 * 64 and model["limits"]["max_steps"] == 200


# ------------------------------------------------------------------------------------------ a real browser
@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None:
        pytest.skip("no chromium binary on PATH (scripts/install.sh installs Debian's chromium package)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM)
        yield b
        b.close()


@pytest.fixture
def page(browser, url):
    context = browser.new_context(viewport={"width": 1000, "height": 640})
    pg = context.new_page()
    pg.goto(url + "/")
    yield pg
    context.close()


def connect(page) -> None:
    page.get_by_test_id("api-key").fill(KEY)
    page.get_by_test_id("connect").click()
    page.wait_for_function("() => document.querySelector('[data-testid=model]').options.length > 0")
    assert page.get_by_test_id("error").is_hidden()


def fill(page, prompt: str, **fields) -> None:
    page.get_by_test_id("prompt").fill(prompt)
    for testid, value in fields.items():
        page.get_by_test_id(testid).fill(str(value))


def png_pixels(src: str):
    import numpy as np
    from PIL import Image

    assert src.startswith("data:image/png;base64,")
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(src.split(",", 1)[1]))).convert("RGB"))


#: every src the preview had: each mutation's old value (several in one task still count), and the current one
WATCH_PREVIEW = """() => { window.previews = []; const img = document.querySelector('[data-testid=preview]');
  new MutationObserver((records) => { for (const r of records) window.previews.push(r.oldValue);
                                      window.previews.push(img.getAttribute('src')); })
    .observe(img, {attributes: true, attributeFilter: ['src'], attributeOldValue: true}); }"""
RESULT_SHOWN = """(old) => { const i = document.querySelector('[data-testid=result]');
  return i.src !== old && i.src.startsWith('data:') && i.complete && i.naturalWidth > 0 }"""


@needs_browser
def test_generate_shows_live_previews_then_the_result_the_prompt_asks_for(page):
    import torch
    from omni_model_shapes.judge import judge_image

    connect(page)
    page.evaluate(WATCH_PREVIEW)
    fill(page, "a red circle in the top left", size="32x32", steps=8, seed=0)
    page.get_by_test_id("generate").click()
    page.wait_for_function(RESULT_SHOWN, arg="", timeout=60_000)
    previews = page.evaluate("window.previews")
    assert len(set(p for p in previews if p)) >= 3, f"the preview changed {len(set(previews))} times"
    assert all(png_pixels(p).shape[:2] == (32, 32) for p in set(previews) if p)
    image = png_pixels(page.get_by_test_id("result").get_attribute("src"))
    assert image.shape == (32, 32, 3)
    seen = judge_image(torch.from_numpy(image.copy()).permute(2, 0, 1).float() / 255)
    assert (seen.colour, seen.shape, seen.position) == ("red", "circle", "top left")
    assert page.get_by_test_id("preview").get_attribute("data-step") == "8"  # the last step's preview
    assert page.get_by_test_id("progress").evaluate("p => [p.value, p.max]") == [8, 8]
    assert page.get_by_test_id("error").is_hidden()
    # a second one: the history lists both, newest first, with their settings
    first = page.get_by_test_id("result").get_attribute("src")
    fill(page, "a blue square in the bottom right", seed=1)
    page.get_by_test_id("generate").click()
    page.wait_for_function(RESULT_SHOWN, arg=first, timeout=60_000)
    items = page.get_by_test_id("history").locator("li")
    assert items.count() == 2
    assert "a blue square in the bottom right" in items.nth(0).inner_text()
    assert "seed: 0" in items.nth(1).inner_text() and "num_inference_steps: 8" in items.nth(1).inner_text()
    target = os.environ.get("OMNI_PLAYGROUND_SCREENSHOT")
    if target:
        page.screenshot(path=target, full_page=True)


@needs_browser
def test_without_the_key_the_page_shows_the_servers_401_message(page, url):
    expected = httpx.get(url + "/v1/models").json()["error"]["message"]
    error = page.get_by_test_id("error")
    error.wait_for(state="visible")
    assert error.inner_text() == expected and "API key" in expected
    page.get_by_test_id("api-key").fill("wrong")
    fill(page, "a red circle in the top left")
    page.get_by_test_id("generate").click()  # tries the models again with the (wrong) key
    page.wait_for_function("(m) => document.querySelector('[data-testid=error]').innerText === m", arg=expected)
    assert page.get_by_test_id("model").evaluate("s => s.options.length") == 0


@needs_browser
def test_stop_ends_a_50_step_request_within_a_step(page, url):
    connect(page)
    fill(page, "a green cross in the center", size="64x64", steps=50, seed=2)  # the largest size: ~0.1 s a step
    before = metric(url, "omni_denoise_steps_total")
    aborted = metric(url, "omni_engine_requests_total", 'outcome="aborted"')
    page.get_by_test_id("generate").click()
    page.wait_for_function("() => Number(document.querySelector('[data-testid=preview]').dataset.step) >= 5",
                           timeout=60_000)
    page.get_by_test_id("stop").click()
    at_stop, stopped_at = metric(url, "omni_denoise_steps_total"), time.monotonic()
    while True:  # the engine drops the request at its next step boundary
        health = httpx.get(url + "/health").json()
        if health["running"] == 0 and health["waiting"] == 0:
            break
        assert time.monotonic() - stopped_at < 10, f"still running 10 s after Stop: {health}"
        time.sleep(0.01)
    after = metric(url, "omni_denoise_steps_total")
    assert after - at_stop <= 2, f"{after - at_stop:g} steps ran after Stop (the one running, at most one more)"
    assert 5 <= after - before < 50
    assert metric(url, "omni_engine_requests_total", 'outcome="aborted"') == aborted + 1
    page.wait_for_function("() => document.querySelector('[data-testid=status]').innerText === 'stopped'")
    assert page.get_by_test_id("stop").is_disabled() and page.get_by_test_id("generate").is_enabled()
    assert page.get_by_test_id("result").get_attribute("src") is None
    assert page.get_by_test_id("error").is_hidden()


@needs_browser
def test_a_bad_size_shows_the_servers_error_text(page, url):
    body = {"prompt": "a red circle", "size": "30x30", "model": "shapes", "stream": True}
    expected = api(url, "POST", "/v1/images/generations", json=body).json()["error"]["message"]
    assert "height=30" in expected and "multiple of 4" in expected
    connect(page)
    fill(page, "a red circle", size="30x30")
    page.get_by_test_id("generate").click()
    error = page.get_by_test_id("error")
    error.wait_for(state="visible")
    assert error.inner_text() == expected
    assert page.get_by_test_id("history").locator("li").count() == 0

HISTORY_HAS = """(n) => { const i = document.querySelector('[data-testid=result]');
  return document.querySelector('[data-testid=history]').children.length >= n && i.complete && i.naturalWidth > 0 }"""


@needs_browser
def test_an_edit_model_takes_the_input_images_from_the_page(browser, test_pipeline_site, start_server, tmp_path):
    """An image-input model (the test-only edit pipeline, in-process: the same app ``omni serve`` builds) shows
    the file field; the page's edit, with one image and then with two, gives the same pixels as the same edit
    sent to the API directly (two files: every one of them is sent, as OpenAI's ``image[]``)."""
    import numpy as np
    from PIL import Image
    from omni_test_pipeline.pipeline import TinyEditTestPipeline

    folder = tmp_path / "tiny-edit"
    TinyEditTestPipeline.save(str(folder))
    live = start_server(str(folder), {"streaming_output": True, "warmup": False}, served_model_name="tiny-edit",
                        api_key=None)
    red, blue = tmp_path / "red.png", tmp_path / "blue.png"
    Image.fromarray(np.full((16, 16, 3), (220, 30, 30), np.uint8)).save(red)
    Image.fromarray(np.full((20, 24, 3), (20, 40, 230), np.uint8)).save(blue)
    cases = [[red], [red, blue]]
    shown = []
    context = browser.new_context()
    page = context.new_page()
    try:
        page.goto(live.url + "/playground")
        page.wait_for_function("() => document.querySelector('[data-testid=model]').options.length > 0")
        assert page.get_by_test_id("image").is_visible()  # this model takes an input image
        fill(page, "edit", size="16x16", steps=3, seed=4)
        for n, files in enumerate(cases, start=1):
            page.get_by_test_id("image").set_input_files([str(f) for f in files])
            page.get_by_test_id("generate").click()
            # the n-th result is in the history (its src may equal the previous one's)
            page.wait_for_function(HISTORY_HAS, arg=n, timeout=60_000)
            assert page.get_by_test_id("preview").get_attribute("data-step") == "3"
            shown.append(png_pixels(page.get_by_test_id("result").get_attribute("src")))
    finally:
        context.close()
    for files, pixels in zip(cases, shown):
        field = "image" if len(files) == 1 else "image[]"
        with live.client(key=None) as http:
            r = http.post("/v1/images/edits", files=[(field, (f.name, f.read_bytes(), "image/png")) for f in files],
                          data={"prompt": "edit", "size": "16x16", "num_inference_steps": 3, "seed": 4,
                                "model": "tiny-edit"})
            (item,) = r.json()["data"]
        assert np.array_equal(pixels, png_pixels("data:image/png;base64," + item["b64_json"])), \
            f"the page's edit with {len(files)} image(s) differs from the API's"
    assert not np.array_equal(shown[0], shown[1]), "the second image must change the edit"


def test_the_page_ships_in_the_wheel():
    """Every file of the page matches the package-data patterns of omni-core's pyproject.toml (a wheel
    install serves the page)."""
    import fnmatch
    import tomllib

    from omni_core.serve.routes.playground import ASSETS, FOLDER

    root = Path(__file__).resolve().parents[2]
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    files = sorted(p.name for p in FOLDER.iterdir())
    assert files == sorted(ASSETS)
    for name in files:
        assert any(fnmatch.fnmatch(f"playground/{name}", pat) for pat in patterns["omni_core.serve"]), name


@needs_browser
def test_a_video_model_plays_its_mp4_and_stop_cancels_the_job(browser, start_server, tmp_path):
    """A video model (tiny random Wan, in-process): the page creates a ``/v1/videos`` job, follows its
    progress, plays the MP4; Stop during a long job deletes it (its engine request aborted)."""
    pytest.importorskip("omni_model_wan", reason="the Wan plugin (omni-model-wan) is not installed")
    from omni_model_wan.testing import build_tiny_wan

    live = start_server(build_tiny_wan(tmp_path / "tiny-wan"), {"streaming_output": True, "warmup": False,
                                                                "limits": {"max_steps": 1000}},
                        served_model_name="tiny-wan", api_key=None, video_dir=str(tmp_path / "videos"))
    context = browser.new_context()
    page = context.new_page()
    try:
        page.goto(live.url + "/")
        page.wait_for_function("() => document.querySelector('[data-testid=model]').options.length > 0")
        assert page.get_by_test_id("frames").is_visible() and page.get_by_test_id("image").is_hidden()
        fill(page, "a cat walking", size="16x16", frames=5, steps=2, seed=0)
        page.get_by_test_id("generate").click()
        page.wait_for_function("() => document.querySelector('[data-testid=video]').src.startsWith('blob:')",
                               timeout=60_000)
        size = page.evaluate("async () => (await (await fetch(document.querySelector('[data-testid=video]').src))"
                             ".arrayBuffer()).byteLength")
        assert size > 100 and page.get_by_test_id("history").locator("li video").count() == 1
        (job,) = httpx.get(live.url + "/v1/videos").json()["data"]
        assert job["status"] == "completed" and job["num_frames"] == 5
        fill(page, "a cat walking", steps=1000)  # held running until Stop
        page.get_by_test_id("generate").click()
        page.wait_for_function("() => document.querySelector('[data-testid=status]').innerText"
                               ".startsWith('in progress')", timeout=60_000)
        page.get_by_test_id("stop").click()
        page.wait_for_function("() => document.querySelector('[data-testid=status]').innerText === 'stopped'")
    finally:
        context.close()
    deadline = time.monotonic() + 10  # the stopped job is deleted, its engine request gone
    while [j["id"] for j in httpx.get(live.url + "/v1/videos").json()["data"]] != [job["id"]] \
            or live.engine.stats()["tracked_requests"]:
        assert time.monotonic() < deadline, (httpx.get(live.url + "/v1/videos").json(), live.engine.stats())
        time.sleep(0.05)

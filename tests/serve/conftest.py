"""Fixtures of the server tests (the test-only pipeline plugin and ``tiny_model`` come from tests/conftest.py):
live servers (uvicorn on 127.0.0.1, a free port, a background thread) over real engines."""

from __future__ import annotations

import base64
import io
import re

import pytest

API_KEY = "test-key"


class Live:
    """A running server: ``url``, the ``engine`` it serves, an httpx ``client()`` factory."""

    def __init__(self, engine, thread, app):
        self.engine, self.thread, self.app = engine, thread, app
        self.url = thread.url

    def client(self, key: str | None = API_KEY, **kwargs):
        import httpx

        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=kwargs.pop("timeout", 60), **kwargs)

    def async_client(self, key: str | None = API_KEY, **kwargs):
        import httpx

        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.AsyncClient(base_url=self.url, headers=headers, timeout=kwargs.pop("timeout", 60), **kwargs)


@pytest.fixture(scope="session")
def start_server():
    """``start_server(model, engine_kwargs, app_kwargs)`` -> :class:`Live`; all stopped and closed at the end."""
    from omni_core.config import OmniDiffusionConfig
    from omni_core.engine import make_engine
    from omni_core.serve import ServerThread, build_app

    started = []

    def start(model: str, engine_kwargs: dict | None = None, **app_kwargs) -> Live:
        engine = make_engine(OmniDiffusionConfig.from_kwargs(model=model, **(engine_kwargs or {})))
        app_kwargs.setdefault("api_key", API_KEY)
        app = build_app(engine, **app_kwargs)
        live = Live(engine, ServerThread(app), app)
        started.append(live)
        return live

    yield start
    for live in started:
        live.thread.stop()
        live.engine.close()


@pytest.fixture(scope="session")
def server(tiny_model, start_server) -> Live:
    """The shared server: tiny model, streaming engine (previews), batches of 4, API key required; up to 1000
    steps per request (tests hold requests running with slow steps)."""
    return start_server(tiny_model, {"streaming_output": True, "max_num_seqs": 4, "max_waiting_requests": 64,
                                     "limits": {"max_steps": 1000}})


def _wait_idle(engine, timeout: float = 10.0) -> dict:
    """Poll ``engine.stats()`` until nothing is tracked (aborts finish at the next step boundary)."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        stats = engine.stats()
        if not stats["tracked_requests"] and not stats["waiting"] and not stats["running"]:
            return stats
        if time.monotonic() > deadline:
            return stats
        time.sleep(0.02)


def _decode_png(b64: str):
    import numpy as np
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


@pytest.fixture(scope="session")
def wait_idle():
    return _wait_idle


@pytest.fixture(scope="session")
def decode_png():
    return _decode_png


_SAMPLE = re.compile(r'^[a-zA-Z_:][a-zA-Z0-9_:]*(\{([a-zA-Z_][a-zA-Z0-9_]*="([^"\\]|\\.)*",?)*\})? '
                     r'(-?[0-9.e+-]+|\+Inf|NaN)$')


def _check_exposition(text: str) -> dict[str, str]:
    """Every line is a HELP/TYPE comment or a valid sample; returns the declared type of each metric."""
    types = {}
    for line in text.strip().splitlines():
        if line.startswith("# HELP "):
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in ("counter", "gauge", "histogram"), line
            types[name] = kind
            continue
        assert _SAMPLE.match(line), f"not a Prometheus sample line: {line!r}"
    return types


@pytest.fixture(scope="session")
def check_exposition():
    return _check_exposition

"""``omni serve`` against hostile clients (issue #34): one real server process (an edit model, an API key, one
``--lora-dir``) fed the bodies and tricks a probe of the server found or tried -- bodies that used to stall the event
loop, LoRA paths anywhere on the disk, methods that grew the metrics, a client that leaves mid-body, bytes that
are not HTTP, image bombs, remote URLs -- each answered with the documented status and error code, while
``/health`` stays fast and the server's memory bounded."""

from __future__ import annotations

import json
import os
import random
import re
import select
import socket
import string
import struct
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import httpx
import pytest

#: its tests share one server (a module fixture): on one xdist worker, not started on both
pytestmark = pytest.mark.xdist_group("serve-hostile")

KEY = "hostile-key"
BOUNDARY = "hostileboundary"
AUTH = {"Authorization": f"Bearer {KEY}"}


class ServeProcess:
    """``omni serve ARGS`` in a subprocess (its log in ``log_path``), until :meth:`stop`."""

    def __init__(self, args: list[str], log_path: Path, timeout: float = 120.0) -> None:
        script = Path(sys.executable).parent / "omni"
        cmd = [str(script)] if script.exists() else [sys.executable, "-m", "omni_core.cli"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("OMNI_") or k == "OMNI_STRICT_PLUGINS"}
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen([*cmd, "serve", *args], stdout=subprocess.PIPE, stderr=self._log, text=True,
                                     env=env)
        deadline, self.url = time.monotonic() + timeout, None
        while self.url is None:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.stop()
                raise AssertionError(f"omni serve did not start:\n{log_path.read_text()}")
            if select.select([self.proc.stdout], [], [], 0.5)[0]:
                m = re.search(r"on (http://\S+) ", self.proc.stdout.readline())
                self.url = m.group(1) if m else None
        self.host, port = self.url.removeprefix("http://").split(":")
        self.port = int(port)
        self.stdout: list[str] = []  # uvicorn's access log: drained, or a full pipe would block the server
        threading.Thread(target=lambda: self.stdout.extend(self.proc.stdout), daemon=True).start()

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory) -> Path:
    """The allowed adapter folder (one file in it, a symlink out of it) and a junk file outside it."""
    root = tmp_path_factory.mktemp("hostile-lora")
    allowed, outside = root / "allowed", root / "outside"
    allowed.mkdir()
    outside.mkdir()
    (allowed / "mine.safetensors").write_bytes(b"not really an adapter")
    (outside / "junk.safetensors").write_bytes(b"junk")
    os.symlink(outside / "junk.safetensors", allowed / "escape.safetensors")
    return allowed


@pytest.fixture(scope="module")
def srv(edit_model, lora_dir, tmp_path_factory):
    proc = ServeProcess([edit_model, "--port", "0", "--api-key", KEY, "--lora-dir", str(lora_dir), "--no-warmup",
                         "--log-level", "info"], tmp_path_factory.mktemp("hostile-log") / "serve.log")
    yield proc
    proc.stop()


def client(srv, key: str | None = KEY) -> httpx.Client:
    return httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=60)


def form(parts: list[tuple[str, str | None, bytes]]) -> tuple[bytes, str]:
    """A multipart body of ``(name, filename or None, bytes)`` parts and its Content-Type."""
    out = []
    for name, filename, data in parts:
        disp = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        out.append(f"--{BOUNDARY}\r\nContent-Disposition: {disp}\r\n\r\n".encode() + data + b"\r\n")
    return b"".join(out) + f"--{BOUNDARY}--\r\n".encode(), f"multipart/form-data; boundary={BOUNDARY}"


def error_of(r: httpx.Response, status: int, code: str) -> dict:
    assert r.status_code == status, r.text[:300]
    err = r.json()["error"]
    assert err["code"] == code and err["type"], err
    return err


def series(srv, metric: str = "omni_http_requests_total") -> set[str]:
    text = httpx.get(f"{srv.url}/metrics", timeout=30).text
    return {line.rsplit(" ", 1)[0] for line in text.splitlines() if line.startswith(metric + "{")}


def raw(srv, data: bytes, read: bool = True) -> bytes:
    with socket.create_connection((srv.host, srv.port), timeout=30) as sock:
        sock.sendall(data)
        out = b""
        while read:
            chunk = sock.recv(65536)
            if not chunk:
                break
            out += chunk
    return out


def png_declaring(width: int, height: int) -> bytes:
    """A tiny PNG whose header declares ``width x height`` pixels (a decompression bomb's shape)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def small_png() -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (16, 16), "red").save(buf, format="PNG")
    return buf.getvalue()


# ------------------------------------------------------------------------------------------ body limits
def test_too_many_form_parts_is_413_before_parsing(srv):
    body, ctype = form([("image[]", "a.png", b"")] * 3000 + [("prompt", None, b"x")])
    with client(srv) as c:
        for path in ("/v1/images/edits", "/v1/videos"):
            start = time.perf_counter()
            err = error_of(c.post(path, content=body, headers={"Content-Type": ctype}), 413, "too_many_form_parts")
            assert time.perf_counter() - start < 1.0
            assert "max_form_parts=64" in err["message"] and "--max-form-parts" in err["message"], err
        urlencoded = "&".join(f"f{i}=" for i in range(1000)).encode()
        err = error_of(c.post("/v1/videos", content=urlencoded,
                              headers={"Content-Type": "application/x-www-form-urlencoded"}), 413, "too_many_form_parts")


def test_json_with_too_many_elements_is_413_before_parsing(srv):
    body = b'{"messages": [' + b"[]," * 5_000_000 + b'[]]}'  # 15 MiB of empty arrays
    with client(srv) as c:
        start = time.perf_counter()
        err = error_of(c.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"}),
                       413, "json_too_large")
        assert time.perf_counter() - start < 2.0
    assert "max_json_elements=10000" in err["message"] and "--max-json-elements" in err["message"], err


@pytest.mark.parametrize("levels", [100, 5000])  # parsed and measured; beyond the parser's recursion limit
def test_json_nested_too_deep_is_400_naming_the_field(srv, levels):
    body = b'{"prompt": "x", "extra_args": ' + b'{"a": ' * levels + b"1" + b"}" * levels + b"}"
    with client(srv) as c:
        err = error_of(c.post("/v1/images/generations", content=body, headers={"Content-Type": "application/json"}),
                       400, "json_too_deep")
    assert err["param"] == "extra_args" and "max_json_depth=64" in err["message"], err


def _health_while_parsing(srv, bodies) -> tuple[list[float], list[int], float]:
    """/health latencies while ``bodies`` are posted at once, their statuses, and the server's RSS growth (MiB)."""
    import psutil

    proc = psutil.Process(srv.proc.pid)
    with client(srv) as c:
        c.get("/health")
    rss0, peak, statuses, done = proc.memory_info().rss, [0], [], threading.Event()

    def post(path, body, ctype):
        with client(srv) as c:
            statuses.append(c.post(path, content=body, headers={"Content-Type": ctype}).status_code)

    def watch_rss():
        while not done.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.01)

    threads = [threading.Thread(target=post, args=b) for b in bodies] + [threading.Thread(target=watch_rss)]
    latencies = []
    with client(srv, key=None) as health:
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads[:-1]):
            start = time.perf_counter()
            assert health.get("/health").status_code == 200
            latencies.append(time.perf_counter() - start)
            time.sleep(0.01)
    done.set()
    threads[-1].join()
    return latencies, statuses, (peak[0] - rss0) / 2**20


def test_health_stays_fast_and_memory_bounded_while_the_worst_allowed_bodies_are_parsed(srv):
    """The largest bodies the limits allow, several at once: 64 parts of 32 MiB of short lines (a line-by-line MIME
    parser took seconds and hundreds of MiB on it), a 32 MiB JSON string, 10 000 JSON elements."""
    fields = [("prompt", None, b"x"), ("model", None, b"nope")]  # parsed in full, then a 404 (no work queued)
    lines, _ = form([("image[]", f"{i}.png", b"\n" * ((31 << 20) // 64)) for i in range(62)] + fields)
    big_json = json.dumps({"model": "nope", "messages": [{"role": "user", "content": "x" * (31 << 20)}]}).encode()
    elements = json.dumps({"model": "nope", "messages": [{"role": "user", "content": "x"}],
                           "extra_args": {"a": [0] * 9_900}}).encode()
    bodies = [("/v1/images/edits", lines, f"multipart/form-data; boundary={BOUNDARY}"),
              ("/v1/chat/completions", big_json, "application/json"),
              ("/v1/images/edits", form([("image[]", "a.png", b"")] * 62 + fields)[0],
               f"multipart/form-data; boundary={BOUNDARY}"),
              ("/v1/chat/completions", elements, "application/json")]
    # measured alone: max 50-92 ms (the requirement is 100 ms); the bound leaves room for a busy shared runner and
    # still catches a parse on the event loop (the old MIME parser stalled it for seconds on these bodies). A
    # second try when the first misses it: a stall of the loop repeats, a slow moment of a shared CI machine does
    # not (one probe of 19 took 278 ms in a CI run on a slow hour, median 8.7 ms)
    for attempt in (1, 2):
        latencies, statuses, growth = _health_while_parsing(srv, bodies)
        print(f"\n/health during the worst allowed bodies (try {attempt}): {len(latencies)} probes, max "
              f"{max(latencies) * 1000:.1f} ms, median {sorted(latencies)[len(latencies) // 2] * 1000:.1f} ms; RSS "
              f"growth {growth:.0f} MiB")
        assert statuses == [404] * len(bodies), statuses  # each parsed in full, then refused
        assert growth < 200, growth
        if max(latencies) < 0.25:
            break
    assert max(latencies) < 0.25, latencies


# ------------------------------------------------------------------------------------------ LoRA files
def test_lora_outside_the_allowed_dirs_gets_one_fixed_answer(srv, lora_dir):
    outside = lora_dir.parent / "outside"
    probes = ["/etc", "/etc/passwd", "/no/such/file.safetensors", str(outside / "junk.safetensors"),
              str(lora_dir / ".." / "outside" / "junk.safetensors"), "../outside/junk.safetensors",
              str(lora_dir / "escape.safetensors"), "escape.safetensors", "missing.safetensors", "nope", "a\x00b"]
    bodies = set()
    with client(srv) as c:
        added = c.get("/metrics").text.count('outcome="added"')
        for lora in probes:
            r = c.post("/v1/images/generations", json={"prompt": "x", "lora": lora})
            err = error_of(r, 400, "lora_not_allowed")
            assert err["param"] == "lora" and "outside" not in r.text and "etc" not in r.text, r.text
            bodies.add(r.content)
        assert len(bodies) == 1, bodies  # same bytes whether the path exists or not
        for lora in ("mine.safetensors", str(lora_dir / "mine.safetensors")):  # allowed: the engine checks the file
            body, ctype = form([("image", "a.png", small_png()), ("prompt", None, b"x"), ("lora", None, lora.encode())])
            err = c.post("/v1/images/edits", content=body, headers={"Content-Type": ctype}).json()["error"]
            assert err["param"] == "lora" and err["code"] != "lora_not_allowed", err
        assert c.get("/metrics").text.count('outcome="added"') == added


# ------------------------------------------------------------------------------------------ metrics
def test_random_methods_add_no_metric_series(srv):
    rng = random.Random(0)

    def burst(n):
        with client(srv, key=None) as anon, client(srv) as auth:
            for i in range(n):
                method = "".join(rng.choices(string.ascii_uppercase, k=rng.randint(3, 12)))
                path = f"/v1/{rng.choice(['models', 'images/generations', 'x' + str(i)])}"
                (anon if i % 2 else auth).request(method, path)

    burst(20)
    series(srv)  # a first read adds its own series (GET /metrics 200) whatever ran before this test
    before = series(srv)
    burst(1000)
    assert series(srv) == before
    assert all('method="other"' in s or re.search(r'method="(GET|POST|HEAD|DELETE|OPTIONS|PUT|PATCH)"', s)
               for s in before), before
    assert any('path="unauthenticated"' in s for s in before), before


def test_a_client_leaving_mid_body_is_499_not_500_and_logs_no_traceback(srv):
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n").encode()
    for _ in range(3):
        raw(srv, head + b'{"messages": [', read=False)
    deadline = time.monotonic() + 10
    while not any('status="499"' in s and "/v1/chat/completions" in s for s in series(srv)):
        assert time.monotonic() < deadline, series(srv)
        time.sleep(0.05)
    assert not any('status="500"' in s for s in series(srv)), series(srv)
    log = srv.log()
    # logged at INFO (the omni_core logger of `omni serve` shows WARNING and above): no error, no traceback
    assert "Traceback" not in log and "unhandled error" not in log and "error:" not in log, log[-2000:]


# ------------------------------------------------------------------------------------------ HTTP itself
@pytest.mark.parametrize("request_bytes", [
    b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\ncontent-length: (\r\n\r\n",
    b"GARBAGE\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: x\r\nbad header line\r\n\r\n",
])
def test_malformed_http_is_answered_in_the_json_error_shape(srv, request_bytes):
    head, _, body = raw(srv, request_bytes).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"content-type: application/json" in head.lower(), head
    assert json.loads(body)["error"]["code"] == "malformed_http"


# ------------------------------------------------------------------------------------------ images and URLs
def test_an_image_bomb_is_refused_before_decoding(srv):
    body, ctype = form([("image", "bomb.png", png_declaring(100_000, 100_000)), ("prompt", None, b"x")])
    with client(srv) as c:
        start = time.perf_counter()
        err = error_of(c.post("/v1/images/edits", content=body, headers={"Content-Type": ctype}), 400,
                       "image_too_large")
    assert err["param"] == "image" and time.perf_counter() - start < 2.0, err


def test_remote_image_urls_are_refused_without_a_connection(srv):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.5)
    url = f"http://127.0.0.1:{listener.getsockname()[1]}/cat.png"
    try:
        with client(srv) as c:
            r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [
                {"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": url}}]}]})
            err = error_of(r, 400, "invalid_image")
            assert "does not fetch remote URLs" in err["message"], err
            body, ctype = form([("image", None, url.encode()), ("prompt", None, b"x")])
            error_of(c.post("/v1/images/edits", content=body, headers={"Content-Type": ctype}), 400, "invalid_image")
        with pytest.raises(socket.timeout):
            listener.accept()
    finally:
        listener.close()


# ------------------------------------------------------------------------------------------ auth tricks
@pytest.mark.parametrize("path, headers", [
    ("/health/../v1/models", {}),
    ("//v1/models", {}),
    ("/v1/models?api_key=" + KEY, {}),
    ("/v1/models", {"Authorization": f"Bearer {KEY}, Bearer {KEY}"}),
    ("/v1/models", {"Authorization": f"Token {KEY}"}),
    ("/v1/models", {"X-Api-Key": KEY}),
])
def test_auth_tricks_are_401(srv, path, headers):
    """Sent over a raw socket: an HTTP client would normalize ``/health/../v1/models`` before sending it."""
    extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    head, _, body = raw(srv, f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{extra}\r\n".encode()
                        ).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 401"), head
    assert json.loads(body)["error"]["code"] == "invalid_api_key"

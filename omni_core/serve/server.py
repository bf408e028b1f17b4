"""Running the app on uvicorn: in the foreground (``omni serve``) or on a background thread (tests, notebooks)."""

from __future__ import annotations

import threading
from typing import Any, Callable


#: seconds uvicorn waits beyond the app's shutdown grace before it cancels what is left: an abort ends a
#: running request within one denoising step, and its error answer must still go out
ABORT_MARGIN_S = 30.0


#: the answer to bytes that are not HTTP/1.1 (a malformed request line or header, a bad Content-Length), in the
#: error shape of every other answer
MALFORMED_HTTP = {"error": {"message": "the request is not valid HTTP/1.1 (a malformed request line, header or "
                                       "Content-Length)", "type": "invalid_request_error", "param": None,
                            "code": "malformed_http"}}


def json_h11_protocol() -> type:
    """uvicorn's h11 protocol answering a request it cannot parse with :data:`MALFORMED_HTTP` (JSON) instead of
    its own text/plain 400; the connection is closed after it, as uvicorn does."""
    import json

    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    body = json.dumps(MALFORMED_HTTP).encode()

    class JSONErrorH11Protocol(H11Protocol):
        def send_400_response(self, msg: str) -> None:
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                       (b"connection", b"close")]
            try:
                self.transport.write(self.conn.send(h11.Response(status_code=400, headers=headers,
                                                                 reason=b"Bad Request")))
                self.transport.write(self.conn.send(h11.Data(data=body)))
                self.transport.write(self.conn.send(h11.EndOfMessage()))
            except h11.LocalProtocolError:  # h11 cannot answer in this state (e.g. mid-response): just close
                pass
            self.transport.close()

    return JSONErrorH11Protocol


def _uvicorn_server(app: Any, host: str, port: int, log_level: str, on_ready: Callable[[str, int], None] | None,
                    access_log: bool = True):
    import uvicorn

    omni = getattr(getattr(app, "state", None), "omni", None)  # the OmniServer of build_app, if this is one
    grace = omni.shutdown_grace_s if omni is not None else 10.0

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets=sockets)
            if self.started and on_ready is not None:
                bound_host, bound_port = self.servers[0].sockets[0].getsockname()[:2]
                on_ready(bound_host, bound_port)

        async def shutdown(self, sockets=None) -> None:
            if omni is not None:  # after the grace period the app aborts what still runs, answering errors
                omni.begin_shutdown()
            await super().shutdown(sockets=sockets)

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on", access_log=access_log,
                            timeout_graceful_shutdown=grace + ABORT_MARGIN_S, http=json_h11_protocol())
    server = Server(config)
    if omni is not None:
        omni.stop_serving = lambda: setattr(server, "should_exit", True)
    return server


def run_server(app: Any, host: str = "127.0.0.1", port: int = 8000, *, log_level: str = "info",
               access_log: bool = True, on_ready: Callable[[str, int], None] | None = None) -> None:
    """Serve ``app`` until SIGINT/SIGTERM; ``on_ready(host, port)`` runs once listening (``port=0`` picks one)."""
    _uvicorn_server(app, host, port, log_level, on_ready, access_log).run()


class ServerThread:
    """``app`` served by uvicorn on a background thread (own event loop) at ``http://host:port``.

        with ServerThread(build_app(engine)) as srv:
            httpx.get(f"{srv.url}/health")
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, *, log_level: str = "warning",
                 start_timeout: float = 60.0) -> None:
        self.host, self.port = host, port
        self._ready = threading.Event()

        def ready(bound_host: str, bound_port: int) -> None:
            self.host, self.port = bound_host, bound_port
            self._ready.set()

        self.server = _uvicorn_server(app, host, port, log_level, ready, access_log=False)
        self._thread = threading.Thread(target=self.server.run, name="omni-serve", daemon=True)
        self._thread.start()
        while not self._ready.wait(0.05):
            if not self._thread.is_alive():
                raise RuntimeError(f"the server on {host}:{port} failed to start (see the log above)")
            start_timeout -= 0.05
            if start_timeout <= 0:
                self.stop()
                raise TimeoutError(f"the server on {host}:{port} did not start")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout: float = 30.0) -> None:
        """Graceful shutdown (runs the app's lifespan shutdown) and join the thread."""
        self.server.should_exit = True
        self._thread.join(timeout)

    def __enter__(self) -> ServerThread:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

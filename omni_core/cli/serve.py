"""``omni serve``: an OpenAI-compatible HTTP server (FastAPI on uvicorn) running the engine in-process."""

from __future__ import annotations

import argparse
import os
import signal
import sys

from omni_core.cli.options import add_engine_options, engine_options
from omni_core.errors import ConfigError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Load MODEL and serve POST /v1/images/generations (stream=true: a preview per step), "
                    "/v1/videos jobs, GET /v1/models, /health and /metrics (Prometheus).",
        epilog="example: omni serve shapes --port 8000   then   curl localhost:8000/v1/images/generations "
               "-H 'Content-Type: application/json' -d '{\"prompt\": \"a red circle\"}'. See docs/serving.md.")
    p.add_argument("model", help="model name (e.g. shapes) or diffusers-format folder")
    srv = p.add_argument_group("server options")
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1; 0.0.0.0 for all)")
    srv.add_argument("--port", type=int, default=8000, help="port (default: 8000; 0 picks a free one, printed)")
    srv.add_argument("--api-key", default=None,
                     help="require 'Authorization: Bearer KEY' on /v1/* (default: $OMNI_API_KEY, else no key)")
    srv.add_argument("--served-model-name", default=None, help="the model name clients use (default: MODEL)")
    srv.add_argument("--max-waiting-requests", type=int, default=64,
                     help="queued requests beyond this get 429 with Retry-After (default: 64)")
    srv.add_argument("--retry-after", type=int, default=1, help="seconds in the Retry-After of a 429 (default: 1)")
    srv.add_argument("--no-stream-previews", action="store_true",
                     help="run the engine without streaming output (stream=true is then refused)")
    srv.add_argument("--video-dir", default=None, help="where video jobs write MP4s (default: a temp dir)")
    srv.add_argument("--max-video-jobs", type=int, default=100, help="size of the video job table (default: 100)")
    srv.add_argument("--video-ttl", type=float, default=3600.0,
                     help="seconds a finished video job and its file are kept (default: 3600)")
    srv.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    eng = add_engine_options(p)
    eng.add_argument("--max-num-seqs", type=int, default=None, help="requests batched in one wave (default: 1)")
    p.set_defaults(func=run_serve)


def _check(args: argparse.Namespace) -> None:
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port {args.port} is invalid: must be 0..65535", field="port")
    for name in ("max_waiting_requests", "max_video_jobs", "retry_after"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(args, name)} is invalid: must be >= 1", field=name)
    if args.video_ttl <= 0:
        raise ConfigError(f"--video-ttl {args.video_ttl} is invalid: must be > 0", field="video_ttl")


def run_serve(args: argparse.Namespace) -> int:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise ConfigError(f"omni serve needs fastapi and uvicorn ({exc}); install them with "
                          f"pip install 'omni-core[serve]'", field="serve") from None
    _check(args)
    from omni_core.engine import make_engine
    from omni_core.entrypoints.common import build_config
    from omni_core.pipelines.loader import resolve_model
    from omni_core.serve.app import build_app
    from omni_core.serve.server import run_server

    opts = engine_options(args)
    opts["max_waiting_requests"] = args.max_waiting_requests
    if args.max_num_seqs is not None:
        opts["max_num_seqs"] = args.max_num_seqs
    if not args.no_stream_previews:
        # previews need step execution; a pipeline without it is served without them
        opts["streaming_output"] = bool(resolve_model(args.model).pipeline_cls().supports_step_execution)
    api_key = args.api_key or os.environ.get("OMNI_API_KEY") or None
    print(f"omni serve: loading {args.model} ...", file=sys.stderr, flush=True)
    engine = make_engine(build_config(args.model, opts))
    app = build_app(engine, served_model_name=args.served_model_name, api_key=api_key, video_dir=args.video_dir,
                    max_video_jobs=args.max_video_jobs, video_ttl_s=args.video_ttl, retry_after_s=args.retry_after,
                    close_engine=True)

    def ready(host: str, port: int) -> None:
        shown = f"[{host}]" if ":" in host else host
        print(f"omni serve: {app.state.omni.model_name} on http://{shown}:{port} "
              f"({engine.execution_mode.value}, previews {'on' if engine.config.streaming_output else 'off'}"
              f"{', API key required' if api_key else ''})", flush=True)

    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal: exit 0 after that
    previous = signal.signal(signal.SIGTERM, _raise_stopped)
    try:
        run_server(app, args.host, args.port, log_level=args.log_level, on_ready=ready)
    except (KeyboardInterrupt, _Stopped):
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        engine.close()  # also when uvicorn failed to start (port in use): the lifespan never ran
    print("omni serve: stopped", file=sys.stderr, flush=True)
    return 0


class _Stopped(Exception):
    pass


def _raise_stopped(signum, frame):
    raise _Stopped()

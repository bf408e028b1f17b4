"""``omni serve``: an OpenAI-compatible HTTP server (FastAPI on uvicorn) running the engine in-process."""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
from typing import Any

from omni_core.cli.options import add_engine_options, engine_options
from omni_core.errors import ConfigError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Load MODEL and serve POST /v1/images/generations (stream=true: a preview per step), "
                    "/v1/videos jobs, GET /v1/models, /health and /metrics (Prometheus).",
        epilog="example: omni serve shapes --port 8000   then   curl localhost:8000/v1/images/generations "
               "-H 'Content-Type: application/json' -d '{\"prompt\": \"a red circle\"}'. See docs/serving.md.")
    p.add_argument("model", nargs="*", metavar="MODEL",
                   help="model name (e.g. shapes) or diffusers-format folder; several (each MODEL or NAME=MODEL) "
                        "are served behind one server, routed by the request's 'model' (docs/serving.md, "
                        "'Several models')")
    many = p.add_argument_group("several models (docs/serving.md, 'Several models')")
    many.add_argument("--models-file", default=None, metavar="FILE",
                      help="a .toml or .json file of models (name, model, each model's engine options, pinned, "
                           "working_memory) and their [residency]")
    many.add_argument("--device-budget", default=None, metavar="SIZE",
                      help="bytes the models on the device may hold together, weights and working memory (e.g. "
                           "'20GiB'); the least recently used idle model is evicted to make room (default: no limit)")
    many.add_argument("--host-budget", default=None, metavar="SIZE",
                      help="bytes of host copies of evicted models, which come back without a load (default: no "
                           "limit; 0: an evicted model is unloaded)")
    many.add_argument("--contention", default=None, choices=("wait", "fail"),
                      help="when busy models hold the budget: wait for room (up to --contention-timeout) or fail "
                           "at once with 503 (default: wait)")
    many.add_argument("--contention-timeout", type=float, default=None, metavar="S",
                      help="seconds a request waits for room (default: 60)")
    many.add_argument("--restart", default=None, choices=("on_request", "never"),
                      help="a model whose engine died: restarted by its next request, or reported dead (default: "
                           "on_request)")
    many.add_argument("--pin", action="append", default=[], metavar="NAME",
                      help="keep this model on the device (loaded at start, never evicted); repeatable")
    srv = p.add_argument_group("server options")
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1; 0.0.0.0 for all)")
    srv.add_argument("--port", type=int, default=8000, help="port (default: 8000; 0 picks a free one, printed)")
    srv.add_argument("--api-key", default=None,
                     help="require 'Authorization: Bearer KEY' on every route but /health and /metrics "
                          "(default: $OMNI_API_KEY, else no key; an empty key is refused)")
    srv.add_argument("--no-auth", action="store_true", help="serve without an API key, even if $OMNI_API_KEY is set")
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
    srv.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES,
                     help=f"larger request bodies get 413 (default: {MAX_BODY_BYTES})")
    srv.add_argument("--max-upload-bytes", type=int, default=MAX_UPLOAD_BYTES,
                     help="the body cap of the routes that take input images: /v1/images/edits, /v1/videos, "
                          f"/v1/chat/completions (default: {MAX_UPLOAD_BYTES})")
    srv.add_argument("--max-form-parts", type=int, default=MAX_FORM_PARTS, metavar="N",
                     help="multipart and url-encoded forms with more parts (fields and files) get 413 "
                          f"(default: {MAX_FORM_PARTS})")
    srv.add_argument("--max-json-depth", type=int, default=MAX_JSON_DEPTH, metavar="N",
                     help=f"JSON bodies nested deeper get 400 (default: {MAX_JSON_DEPTH})")
    srv.add_argument("--max-json-elements", type=int, default=MAX_JSON_ELEMENTS, metavar="N",
                     help="JSON bodies with more arrays, objects and elements ('[', '{' and ',' counted before "
                          f"parsing) get 413 (default: {MAX_JSON_ELEMENTS})")
    srv.add_argument("--max-rollout-samples", type=int, default=64, metavar="N",
                     help="/rollout/generate: most samples (num_outputs_per_prompt) one request may ask (default: 64)")
    srv.add_argument("--max-rollout-steps", type=int, default=64, metavar="N",
                     help="/rollout/generate: most steps of latent trajectory one request may ask back (default: 64)")
    srv.add_argument("--max-rollout-bytes", type=int, default=256 * 1024 * 1024, metavar="N",
                     help="/rollout/generate: larger answers are refused (default: 256 MiB)")
    srv.add_argument("--lora-dir", action="append", default=[], metavar="DIR", dest="lora_dirs",
                     help="a folder whose adapter files a request's 'lora' may name (repeatable; default: none, "
                          "only the names given with --lora)")
    srv.add_argument("--shutdown-grace", type=float, default=SHUTDOWN_GRACE_S,
                     help="seconds in-flight requests get at SIGINT/SIGTERM before they are aborted and answered "
                          f"with an error (default: {SHUTDOWN_GRACE_S:g})")
    srv.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    lim = p.add_argument_group("request limits (default: the model's; checked before any work)")
    for flag, what in LIMIT_FLAGS.items():
        lim.add_argument(f"--{flag.replace('_', '-')}", type=int, default=None, metavar="N",
                         help=f"the most {what} one request may ask for")
    eng = add_engine_options(p)
    eng.add_argument("--max-num-seqs", type=int, default=None,
                     help="requests batched in one wave (default: batching on, up to 8 within a pixel budget; 1 "
                          "turns it off; docs/scheduling.md)")
    if "--no-warmup" not in p._option_string_actions:  # the shared engine options may already have it
        eng.add_argument("--no-warmup", action="store_true", help="skip the start-up warmup (a one-step request)")
    eng.add_argument("--oversubscribe", action="store_true",
                     help="start more worker processes than the platform has devices (CPU: usable cores)")
    from omni_core.cli.lora import add_lora_options

    add_lora_options(p.add_argument_group("LoRA adapters (docs/lora.md)"))
    p.set_defaults(func=run_serve)


#: RequestLimits field -> what it bounds (the flag is --max-pixels etc.)
LIMIT_FLAGS = {"max_pixels": "pixels (height x width) per output", "max_steps": "denoising steps",
               "max_outputs": "outputs per prompt (n)", "max_frames": "video frames",
               "max_prompt_chars": "characters in the prompt (and in the negative prompt)",
               "max_image_pixels": "pixels (height x width) per input image (edit and image-to-video models)"}
#: the same defaults as omni_core.serve.app (not imported: `omni serve --help` must not load FastAPI)
MAX_BODY_BYTES = 1 << 20
MAX_UPLOAD_BYTES = 32 << 20
MAX_FORM_PARTS = 64
MAX_JSON_DEPTH = 64
MAX_JSON_ELEMENTS = 10_000
SHUTDOWN_GRACE_S = 10.0
#: exit status of `omni serve` when it stopped because its engine died (a supervisor should restart it)
EXIT_ENGINE_DEAD = 3


def _api_key(args: argparse.Namespace) -> str | None:
    """The key from --api-key, else $OMNI_API_KEY; an empty one is refused (it would silently mean "no auth")."""
    if args.no_auth:
        if args.api_key is not None:
            raise ConfigError("--api-key and --no-auth contradict each other; give one", field="api_key")
        return None
    for value, source in ((args.api_key, "--api-key"), (os.environ.get("OMNI_API_KEY"), "$OMNI_API_KEY")):
        if value is None:
            continue
        if not value.strip() or any(c.isspace() for c in value):
            raise ConfigError(f"{source} {value!r} is invalid: the key must be non-empty and contain no whitespace; "
                              f"to serve without authentication leave it unset or pass --no-auth", field="api_key")
        return value
    return None


def _check(args: argparse.Namespace) -> None:
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port {args.port} is invalid: must be 0..65535", field="port")
    for name in ("max_waiting_requests", "max_video_jobs", "retry_after"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(args, name)} is invalid: must be >= 1", field=name)
    if args.video_ttl <= 0:
        raise ConfigError(f"--video-ttl {args.video_ttl} is invalid: must be > 0", field="video_ttl")
    if args.max_body_bytes < 1:
        raise ConfigError(f"--max-body-bytes {args.max_body_bytes} is invalid: must be >= 1", field="max_body_bytes")
    if args.max_upload_bytes < 1:
        raise ConfigError(f"--max-upload-bytes {args.max_upload_bytes} is invalid: must be >= 1",
                          field="max_upload_bytes")
    for name in ("max_form_parts", "max_json_depth", "max_json_elements", "max_rollout_samples", "max_rollout_steps",
                 "max_rollout_bytes"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(args, name)} is invalid: must be >= 1", field=name)
    for d in args.lora_dirs:
        if not os.path.isdir(d):
            raise ConfigError(f"--lora-dir {d!r} is not a directory", field="lora_dirs")
    if not args.shutdown_grace >= 0:
        raise ConfigError(f"--shutdown-grace {args.shutdown_grace} is invalid: must be >= 0", field="shutdown_grace")


def run_serve(args: argparse.Namespace) -> int:
    from omni_core.utils import progress as stages

    with stages.shown("omni serve"):  # start-up progress on stderr, one line per stage
        return _serve(args)


def _serve(args: argparse.Namespace) -> int:
    from omni_core.utils.progress import progress

    try:
        for library in ("fastapi", "uvicorn"):
            importlib.import_module(library)
    except ImportError as exc:
        raise ConfigError(f"omni serve needs fastapi and uvicorn ({exc}); install them with "
                          f"pip install 'omni-core[serve]'", field="serve") from None
    _check(args)
    api_key = _api_key(args)
    from omni_core.engine.client import start_engine
    from omni_core.config import RequestLimits
    from omni_core.entrypoints.common import build_config
    from omni_core.pipelines.shape_check import check_before_loading

    opts = engine_options(args)
    opts["max_waiting_requests"] = args.max_waiting_requests
    if args.max_num_seqs is not None:
        opts["max_num_seqs"] = args.max_num_seqs
    limits = {name: getattr(args, name) for name in LIMIT_FLAGS if getattr(args, name) is not None}
    if limits:
        opts["limits"] = limits
    if args.oversubscribe:
        opts["oversubscribe"] = True
    from omni_core.cli.lora import lora_options

    opts.update(lora_options(args)[0])
    if args.no_warmup:
        opts["warmup"] = False
    if limits:
        try:
            RequestLimits.coerce(limits)
        except ConfigError as exc:
            flag = f"--{exc.field.replace('_', '-')}" if exc.field in LIMIT_FLAGS else None
            if flag is None:
                raise
            raise ConfigError(str(exc).replace(f"RequestLimits.{exc.field}=", f"{flag} "), field=exc.field) from None
    fleet_config = _fleet_config(args, opts)
    if fleet_config is not None:
        return _serve_app(args, api_key, *_start_fleet(args, fleet_config))
    (model,) = args.model
    # what needs no model is refused before it loads: the model name or folder, the engine options
    resolved = check_before_loading(model, pipeline=args.pipeline)
    build_config(model, opts)  # the engine options, checked before anything loads
    progress(f"loading {model} (importing torch, reading the weights) ...")
    if not args.no_stream_previews:
        # previews need step execution; a pipeline without it is served without them
        cls = resolved.pipeline_cls()
        opts["streaming_output"] = bool(cls.supports_step_execution or cls.previews_in_request_mode)
    from omni_core.engine.plan import plan_engine

    # planned once, with the model resolved above: the engine runs the plan and resolves nothing again
    engine = start_engine(plan_engine(build_config(model, opts), resolved=resolved))
    return _serve_app(args, api_key, engine, args.served_model_name)


def _serve_app(args: argparse.Namespace, api_key: str | None, served: Any, served_model_name: str | None) -> int:
    """Serve ``served`` (one engine, or a fleet of models) until stopped; the exit status."""
    from omni_core.serve.app import build_app
    from omni_core.serve.routes.rollout import RolloutLimits
    from omni_core.serve.server import run_server
    from omni_core.utils.progress import elapsed, progress

    app = build_app(served, served_model_name=served_model_name, api_key=api_key, video_dir=args.video_dir,
                    max_video_jobs=args.max_video_jobs, video_ttl_s=args.video_ttl, retry_after_s=args.retry_after,
                    close_engine=True, max_body_bytes=args.max_body_bytes, shutdown_grace_s=args.shutdown_grace,
                    exit_on_engine_death=not hasattr(served, "members"), max_upload_bytes=args.max_upload_bytes,
                    max_form_parts=args.max_form_parts, max_json_depth=args.max_json_depth,
                    max_json_elements=args.max_json_elements, lora_dirs=args.lora_dirs,
                    rollout_limits=RolloutLimits(args.max_rollout_samples, args.max_rollout_steps,
                                                 args.max_rollout_bytes))

    def ready(host: str, port: int) -> None:
        shown = f"[{host}]" if ":" in host else host
        progress(f"ready in {elapsed():.1f} s")
        models = app.state.omni.models
        if len(models) == 1:
            (engine,) = (m.engine for m in models.values())
            what = (f"{app.state.omni.default.name} on http://{shown}:{port} ({engine.stats()['execution_mode']}, "
                    f"previews {'on' if engine.model_info.streaming else 'off'}")
        else:
            what = f"{len(models)} models ({', '.join(models)}) on http://{shown}:{port} (routed by 'model'"
        print(f"omni serve: {what}{', API key required' if api_key else ''})", flush=True)
        print(f"omni serve: playground at http://{shown}:{port}/ (docs/playground.md)", flush=True)

    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal: exit 0 after that
    previous = signal.signal(signal.SIGTERM, _raise_stopped)
    try:
        run_server(app, args.host, args.port, log_level=args.log_level, on_ready=ready)
    except (KeyboardInterrupt, _Stopped):
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        served.close()  # also when uvicorn failed to start (port in use): the lifespan never ran
    if app.state.omni.engine_died:
        print(f"omni serve: stopped because the engine died; exit status {EXIT_ENGINE_DEAD}", file=sys.stderr,
              flush=True)
        return EXIT_ENGINE_DEAD
    print("omni serve: stopped", file=sys.stderr, flush=True)
    return 0


def _fleet_config(args: argparse.Namespace, opts: dict) -> Any:
    """The models to serve when there are several (or a models file), checked before any loads; None for one."""
    from omni_core.config.fleet import FleetConfig

    residency = {"device_budget": args.device_budget, "host_budget": args.host_budget,
                 "contention": args.contention, "wait_timeout_s": args.contention_timeout, "restart": args.restart}
    if args.models_file is None and len(args.model) == 1 and not args.pin \
            and all(v is None for v in residency.values()):
        return None
    if not args.model and args.models_file is None:
        raise ConfigError("omni serve needs a MODEL (or several, or --models-file FILE)", field="model")
    if args.served_model_name is not None and (args.models_file is not None or len(args.model) > 1):
        raise ConfigError("--served-model-name names the one model of a one-model server; name several as "
                          "NAME=MODEL or in the models file", field="served_model_name")
    if args.models_file is not None:
        config = FleetConfig.from_file(args.models_file, common=opts, **residency)
        if args.model:
            extra = FleetConfig.from_specs(args.model, common=opts).models
            config = FleetConfig(models=(*config.models, *extra), residency=config.residency)
    else:
        config = FleetConfig.from_specs(args.model, {k: v for k, v in residency.items() if v is not None}, opts)
    unknown = sorted(set(args.pin) - set(config.names))
    if unknown:
        raise ConfigError(f"--pin {unknown[0]!r} is not a served model; they are: {', '.join(config.names)}",
                          field="pin")
    import attrs

    return FleetConfig(models=[attrs.evolve(m, pinned=m.pinned or m.name in args.pin) for m in config.models],
                       residency=config.residency)


def _start_fleet(args: argparse.Namespace, config: Any) -> tuple[Any, None]:
    """Each model's streaming previews as for one model, then the fleet (every model planned, pinned ones loaded)."""
    import attrs

    from omni_core.engine.client import start_fleet
    from omni_core.pipelines.shape_check import check_before_loading
    from omni_core.utils.progress import progress

    models = []
    for m in config.models:
        resolved = check_before_loading(m.model, pipeline=m.options.get("pipeline"))
        options = dict(m.options)
        if not args.no_stream_previews and "streaming_output" not in options:
            cls = resolved.pipeline_cls()
            options["streaming_output"] = bool(cls.supports_step_execution or cls.previews_in_request_mode)
        models.append(attrs.evolve(m, options=options))
    progress(f"planning {len(models)} models ({', '.join(config.names)}); pinned ones load now ...")
    return start_fleet(attrs.evolve(config, models=models)), None


class _Stopped(Exception):
    pass


def _raise_stopped(signum, frame):
    raise _Stopped()

"""Request bodies of the OpenAI-compatible endpoints: parsing, validation, errors (no web framework here).

Every refusal is an :class:`APIError` that renders as OpenAI's error object
``{"error": {"message", "type", "param", "code"}}``; ``param`` names the offending request field.
Range checks reuse :class:`~omni_core.config.SamplingParams` and the pipeline's ``check_sampling_params``:
their :class:`~omni_core.errors.ConfigError` ``field`` is mapped back to the request field the client sent.
"""

from __future__ import annotations

import json
import math
import numbers
import re
from typing import Any, Mapping, Sequence

import attrs

from omni_core.config import SamplingParams
from omni_core.errors import ConfigError


class APIError(Exception):
    """An HTTP error answered in OpenAI's error shape."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than max_body_bytes={limit} bytes; send a smaller body, or "
                         f"raise the limit with omni serve --max-body-bytes", code="request_too_large")


# ------------------------------------------------------------------------------------------ JSON bodies
#: deepest nesting accepted inside a field (``extra_args``); deeper objects are refused, naming the field
MAX_NESTING = 32
_WS = re.compile(r"[ \t\n\r]*")


def parse_json(raw: bytes) -> Any:
    """The body as JSON, or a 400. A value the parser cannot take (an integer of thousands of digits,
    nesting deeper than the parser's recursion limit) is reported with the top-level field that holds it."""
    if not raw:
        raise invalid("the request body is empty; send a JSON object", None, code="invalid_body")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise invalid(f"the request body is not valid UTF-8: {exc}", None, code="invalid_json") from None
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError, as is the int digit limit
        field = _failing_field(text)
        if isinstance(exc, RecursionError):
            reason = "is nested too deeply"
        elif isinstance(exc, json.JSONDecodeError):
            reason = f"is not valid JSON: {exc}"
        else:
            reason = f"cannot be read: {exc}"
        where = f"'{field}'" if field else "the request body"
        raise invalid(f"{where} {reason}", field, code="invalid_json") from None


def _failing_field(text: str) -> str | None:
    """The key of the top-level object whose value fails to decode (None when it is not such a failure)."""
    decoder = json.JSONDecoder()
    i = _WS.match(text, 0).end()
    if text[i:i + 1] != "{":
        return None
    i += 1
    try:
        while True:
            i = _WS.match(text, i).end()
            if text[i:i + 1] != '"':
                return None
            key, i = json.decoder.scanstring(text, i + 1)
            i = _WS.match(text, i).end()
            if text[i:i + 1] != ":":
                return None
            i = _WS.match(text, i + 1).end()
            try:
                _, i = decoder.raw_decode(text, i)
            except (ValueError, RecursionError):
                return key
            i = _WS.match(text, i).end()
            if text[i:i + 1] != ",":
                return None
            i += 1
    except ValueError:  # a malformed key
        return None


def _depth(value: Any, limit: int) -> int:
    """Nesting depth of a JSON value, counted up to ``limit + 1`` (iterative: no recursion to exhaust)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            if depth > limit:
                return depth
            todo.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    return deepest


#: SamplingParams / pipeline field -> the request field a client sends
_PARAM_OF_FIELD = {"num_outputs_per_prompt": "n", "height": "size", "width": "size", "extra_args": "extra_args"}


def config_error(exc: ConfigError, extra: Mapping[str, str] | None = None) -> APIError:
    """A validation error of omni's config/pipeline as a 400 naming the request field."""
    field = exc.field
    param = {**_PARAM_OF_FIELD, **(extra or {})}.get(field, field) if field else None
    return invalid(str(exc), param)


# ------------------------------------------------------------------------------------------ field checks
_KINDS = {"str": "a string", "int": "an integer", "number": "a number", "bool": "a boolean", "object": "a JSON object",
          "str|number": "a string or a number"}


def _coerce_form(value: Any, kind: str) -> Any:
    """multipart/form-data sends every field as text: read it as the kind the field needs."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    try:
        if kind == "int":
            return int(text)
        if kind in ("number", "str|number"):
            return value if kind == "str|number" else float(text)
        if kind == "bool":
            if text.lower() in ("true", "1"):
                return True
            if text.lower() in ("false", "0"):
                return False
        if kind == "object":
            return json.loads(text)
    except (ValueError, RecursionError):  # not the kind (or unreadable): the field check refuses it by name
        pass
    return value


def _check(name: str, value: Any, kind: str) -> Any:
    ok = {
        "str": isinstance(value, str),
        "int": isinstance(value, numbers.Integral) and not isinstance(value, bool),
        "number": isinstance(value, numbers.Real) and not isinstance(value, bool),
        "bool": isinstance(value, bool),
        "object": isinstance(value, dict),
        "str|number": isinstance(value, (str, numbers.Real)) and not isinstance(value, bool),
    }[kind]
    if not ok:
        shown = repr(value)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        raise invalid(f"'{name}' must be {_KINDS[kind]}, got {type(value).__name__} {shown}", name,
                      code="invalid_type")
    if kind == "number" and not math.isfinite(value):
        raise invalid(f"'{name}' must be a finite number, got {value!r}", name)
    if kind == "object" and _depth(value, MAX_NESTING) > MAX_NESTING:
        raise invalid(f"'{name}' is nested too deeply: at most {MAX_NESTING} levels of objects and arrays", name)
    return value


def _read_fields(body: Any, fields: Mapping[str, str], *, accepted_defaults: Mapping[str, tuple] = (),
                 ignored: tuple[str, ...] = (), unsupported: Mapping[str, str] | None = None,
                 from_form: bool = False) -> dict[str, Any]:
    """Type-check ``body`` against ``fields`` (name -> kind); unknown fields are refused, naming them."""
    if not isinstance(body, dict):
        raise invalid(f"the request body must be a JSON object, got {type(body).__name__}", None,
                      code="invalid_body")
    out: dict[str, Any] = {}
    accepted_defaults = dict(accepted_defaults)
    for name, value in body.items():
        if name in ignored:
            continue
        if unsupported and name in unsupported:
            raise invalid(f"'{name}' is not supported by this server: {unsupported[name]}", name,
                          code="unsupported_parameter")
        if name in accepted_defaults:
            if value is not None and value not in accepted_defaults[name]:
                allowed = ", ".join(repr(v) for v in accepted_defaults[name])
                raise invalid(f"'{name}'={value!r} is not supported by this server; allowed: {allowed}", name,
                              code="unsupported_value")
            continue
        if name not in fields:
            raise invalid(f"unrecognized request argument '{name}'{_declared_elsewhere(name)}; supported: "
                          f"{', '.join(sorted(fields))}", name, code="unknown_parameter")
        if value is None:
            continue  # null means "the default", as in OpenAI's API
        if from_form:
            value = _coerce_form(value, fields[name])
        out[name] = _check(name, value, fields[name])
    return out


_SIZE = re.compile(r"^\s*(\d{1,6})\s*[xX]\s*(\d{1,6})\s*$")


def parse_size(value: str | None, param: str = "size") -> tuple[int, int] | None:
    """``"WIDTHxHEIGHT"`` -> ``(width, height)``; ``None`` or ``"auto"`` -> None (the model's default)."""
    if value is None or value.strip().lower() == "auto":
        return None
    m = _SIZE.match(value)
    if not m:
        raise invalid(f"'{param}'={value!r} is invalid: expected 'WIDTHxHEIGHT' (e.g. '512x512') or 'auto'", param)
    width, height = int(m.group(1)), int(m.group(2))
    if width < 1 or height < 1:
        raise invalid(f"'{param}'={value!r} is invalid: width and height must be positive", param)
    return width, height


def _prompt(fields: dict[str, Any]) -> str:
    prompt = fields.get("prompt")
    if prompt is None:
        raise invalid("'prompt' is required", "prompt", code="missing_required_parameter")
    return prompt  # empty or too long: the engine refuses it (same words as the Python API)


def _sampling(fields: dict[str, Any], names: Mapping[str, str], **fixed: Any) -> SamplingParams:
    kwargs = {target: fields[name] for name, target in names.items() if name in fields}
    size = parse_size(fields.get("size"))
    if size is not None:
        kwargs["width"], kwargs["height"] = size
    try:
        return SamplingParams.from_kwargs(**kwargs, **fixed)
    except ConfigError as exc:
        raise config_error(exc, {v: k for k, v in names.items()}) from None


# ------------------------------------------------------------------------------------------ model fields
_KIND_OF_TYPE = {"float": "number", "int": "int", "bool": "bool", "str": "str", "choice": "str"}


def model_field_kinds(model_fields: Sequence[Any] | None) -> dict[str, str]:
    """Body kinds of a model's declared sampling fields (``SamplingField`` records), so a model's knob is a request
    field by declaration alone. The server passes the served pipeline's (``ModelInfo.sampling_fields``); ``None``
    (parsing with no server) takes every registered pipeline's, leaving the pipeline's own check to refuse one it
    does not declare."""
    if model_fields is None:
        from omni_core.config import registered_sampling_fields

        model_fields = [decls[0][1] for decls in registered_sampling_fields().values()]
    return {f.name: _KIND_OF_TYPE[f.type] for f in model_fields}


def _declared_elsewhere(name: str) -> str:
    """`` (a sampling field of X, Y)`` when other installed pipelines declare ``name``, else ``""``."""
    from omni_core.config import registered_sampling_fields

    owners = [pipeline for pipeline, _ in registered_sampling_fields().get(name, [])]
    return f" (it is a sampling field of {', '.join(owners)}, not of the served model)" if owners else ""


def _with_model_fields(fields: Mapping[str, str], sampling: Mapping[str, str], model_fields: Sequence[Any] | None
                       ) -> tuple[dict[str, str], dict[str, str]]:
    kinds = {k: v for k, v in model_field_kinds(model_fields).items() if k not in fields}
    return {**fields, **kinds}, {**sampling, **{name: name for name in kinds}}


# ------------------------------------------------------------------------------------------ images
#: the core's body fields (name -> kind); a model's declared sampling fields join them (``model_field_kinds``)
IMAGE_FIELDS = {
    "prompt": "str", "model": "str", "n": "int", "size": "str", "response_format": "str", "stream": "bool",
    "negative_prompt": "str", "num_inference_steps": "int", "guidance_scale": "number", "seed": "int",
    "extra_args": "object",
}
#: OpenAI fields accepted only at the value this server produces anyway
IMAGE_ACCEPTED_DEFAULTS = {"quality": ("auto", "standard"), "style": ("vivid", "natural"),
                           "background": ("auto", "opaque"), "output_format": ("png",),
                           "moderation": ("auto", "low")}
IMAGE_UNSUPPORTED = {"partial_images": "a stream sends one preview per denoising step",
                     "output_compression": "images are PNG", "svg": "images are PNG"}
#: request field -> SamplingParams keyword (model-declared fields keep their name)
_IMAGE_SAMPLING = {"n": "num_outputs_per_prompt", "num_inference_steps": "num_inference_steps",
                   "guidance_scale": "guidance_scale", "seed": "seed", "extra_args": "extra_args"}


@attrs.frozen
class ImageRequest:
    prompt: str
    negative_prompt: str | None
    params: SamplingParams
    model: str | None
    stream: bool


def parse_image_request(body: Any, *, model_fields: Sequence[Any] | None = None) -> ImageRequest:
    """``POST /v1/images/generations`` body -> validated :class:`ImageRequest` (or a 400 naming the field).
    ``model_fields``: the served model's declared sampling fields (None: any registered pipeline's)."""
    kinds, sampling = _with_model_fields(IMAGE_FIELDS, _IMAGE_SAMPLING, model_fields)
    fields = _read_fields(body, kinds, accepted_defaults=IMAGE_ACCEPTED_DEFAULTS,
                          ignored=("user", "safety_identifier"), unsupported=IMAGE_UNSUPPORTED)
    prompt = _prompt(fields)
    fmt = fields.get("response_format", "b64_json")
    if fmt != "b64_json":
        raise invalid(f"'response_format'={fmt!r} is not supported: this server returns images inline, use "
                      f"'b64_json'", "response_format", code="unsupported_value")
    params = _sampling(fields, sampling)
    return ImageRequest(prompt=prompt, negative_prompt=fields.get("negative_prompt"), params=params,
                        model=fields.get("model"), stream=fields.get("stream", False))


# ------------------------------------------------------------------------------------------ videos
VIDEO_FIELDS = {
    "prompt": "str", "model": "str", "size": "str", "seconds": "str|number", "num_frames": "int", "fps": "int",
    "negative_prompt": "str", "num_inference_steps": "int", "guidance_scale": "number", "seed": "int",
    "extra_args": "object",
}
VIDEO_UNSUPPORTED = {"input_reference": "only text-to-video is served",
                     "remixed_from_video_id": "remixing is not supported"}
_VIDEO_SAMPLING = {"num_frames": "num_frames", "num_inference_steps": "num_inference_steps",
                   "guidance_scale": "guidance_scale", "seed": "seed", "extra_args": "extra_args"}
MAX_FPS = 120
DEFAULT_FPS = 16


@attrs.frozen
class VideoRequest:
    prompt: str
    negative_prompt: str | None
    params: SamplingParams
    model: str | None
    fps: int
    #: as the client gave it (OpenAI sends strings such as "4"), or None
    seconds: str | None


def frames_for_seconds(seconds: float, fps: int, frame_multiple: int) -> int:
    """The frame count closest to ``seconds`` at ``fps`` that the model accepts (``(n - 1) % multiple == 0``)."""
    target = max(1.0, seconds * fps)
    k = max(0, math.floor((target - 1) / frame_multiple + 0.5))  # half rounds up
    return k * frame_multiple + 1


def parse_video_request(body: Any, *, frame_multiple: int = 1, from_form: bool = False,
                        model_fields: Sequence[Any] | None = None) -> VideoRequest:
    """``POST /v1/videos`` body (JSON or form fields) -> validated :class:`VideoRequest`; ``model_fields`` as in
    :func:`parse_image_request`."""
    kinds, sampling = _with_model_fields(VIDEO_FIELDS, _VIDEO_SAMPLING, model_fields)
    fields = _read_fields(body, kinds, ignored=("user",), unsupported=VIDEO_UNSUPPORTED,
                          accepted_defaults={"quality": ("auto", "standard")}, from_form=from_form)
    prompt = _prompt(fields)
    fps = fields.get("fps", DEFAULT_FPS)
    if not 1 <= fps <= MAX_FPS:
        raise invalid(f"'fps'={fps} is invalid: must be between 1 and {MAX_FPS}", "fps")
    seconds = fields.get("seconds")
    fixed: dict[str, Any] = {}
    if seconds is not None:
        if "num_frames" in fields:
            raise invalid("give either 'seconds' or 'num_frames', not both", "seconds")
        try:
            value = float(seconds)
        except (ValueError, OverflowError):  # OverflowError: an integer beyond float range
            value = float("nan")
        if not math.isfinite(value) or value <= 0 or value > 3600:
            raise invalid(f"'seconds'={seconds!r} is invalid: expected a positive number of seconds (e.g. '4')",
                          "seconds")
        fixed["num_frames"] = frames_for_seconds(value, fps, frame_multiple)
        seconds = str(seconds)
    params = _sampling(fields, sampling, **fixed)
    return VideoRequest(prompt=prompt, negative_prompt=fields.get("negative_prompt"), params=params,
                        model=fields.get("model"), fps=fps, seconds=seconds)


def parse_form(body: bytes, content_type: str) -> dict[str, Any]:
    """Fields of a ``multipart/form-data`` body (what the ``openai`` client sends to ``/v1/videos``).

    Parsed with the standard library's MIME parser so the server needs no extra dependency. A file part
    comes back as ``bytes`` (and is then refused by the field checks).
    """
    from email.parser import BytesParser
    from email.policy import HTTP

    msg = BytesParser(policy=HTTP).parsebytes(b"Content-Type: " + content_type.encode("latin-1") + b"\r\n\r\n"
                                              + body)
    if not msg.is_multipart():
        raise invalid("malformed multipart/form-data body", None, code="invalid_body")
    from email.utils import collapse_rfc2231_value

    fields: dict[str, Any] = {}
    for part in msg.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if not name:
            continue
        name = collapse_rfc2231_value(name)
        payload = part.get_payload(decode=True) or b""
        if part.get_filename() is not None:
            fields[name] = payload
            continue
        charset = part.get_content_charset() or "utf-8"
        try:
            fields[name] = payload.decode(charset)
        except LookupError:
            raise invalid(f"form field '{name}' has an unknown charset {charset!r}; send UTF-8", name,
                          code="invalid_body") from None
        except UnicodeDecodeError as exc:
            raise invalid(f"form field '{name}' is not valid {charset}: {exc}", name, code="invalid_body") from None
    return fields


# ------------------------------------------------------------------------------------------ OpenAPI
_SCHEMA_OF_KIND = {"str": {"type": "string"}, "int": {"type": "integer"}, "number": {"type": "number"},
                   "bool": {"type": "boolean"}, "object": {"type": "object"},
                   "str|number": {"type": ["string", "number"]}}


def body_schema(fields: Mapping[str, str], *, accepted_defaults: Mapping[str, tuple] = (),
                ignored: tuple[str, ...] = ()) -> dict[str, Any]:
    """The JSON schema of a request body read by :func:`_read_fields` (for ``/openapi.json``): the same
    fields, kinds and accepted values, ``prompt`` required, nothing else allowed. ``null`` means "the default"."""
    props: dict[str, Any] = {}
    for name, kind in fields.items():
        schema = dict(_SCHEMA_OF_KIND[kind])
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        schema["type"] = types + ["null"] if name != "prompt" else types[0]
        props[name] = schema
    for name, values in dict(accepted_defaults).items():
        props[name] = {"enum": [*values, None]}
    for name in ignored:
        props[name] = {"type": ["string", "null"]}
    return {"type": "object", "properties": props, "required": ["prompt"], "additionalProperties": False}


def image_body_schema(model_fields: Sequence[Any] | None = None) -> dict[str, Any]:
    return body_schema(_with_model_fields(IMAGE_FIELDS, _IMAGE_SAMPLING, model_fields)[0],
                       accepted_defaults=IMAGE_ACCEPTED_DEFAULTS, ignored=("user", "safety_identifier"))


def video_body_schema(model_fields: Sequence[Any] | None = None) -> dict[str, Any]:
    return body_schema(_with_model_fields(VIDEO_FIELDS, _VIDEO_SAMPLING, model_fields)[0],
                       accepted_defaults={"quality": ("auto", "standard")}, ignored=("user",))

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


def too_large(limit: int, upload: bool = False) -> APIError:
    name = "max_upload_bytes" if upload else "max_body_bytes"
    return APIError(413, f"the request body is larger than {name}={limit} bytes; send a smaller body, or "
                         f"raise the limit with omni serve --{name.replace('_', '-')}", code="request_too_large")


# ------------------------------------------------------------------------------------------ JSON bodies
#: deepest nesting accepted inside a field (``extra_args``); deeper objects are refused, naming the field
MAX_NESTING = 32
#: defaults of ``omni serve --max-json-depth`` / ``--max-json-elements`` (a request is a few dozen fields; a chat
#: message a few parts): they bound what ``json.loads`` -- C code holding the GIL, so the event loop -- may be fed
MAX_JSON_DEPTH = 64
MAX_JSON_ELEMENTS = 10_000
_WS = re.compile(r"[ \t\n\r]*")


def json_too_large(limit: int) -> APIError:
    return APIError(413, f"the JSON body has more than max_json_elements={limit} arrays, objects and elements "
                         f"(counted as '[', '{{' and ','); send a smaller body, or raise the limit with omni serve "
                         f"--max-json-elements", code="json_too_large")


def json_too_deep(limit: int, field: str | None) -> APIError:
    where = f"'{field}'" if field else "the request body"
    return APIError(400, f"{where} is nested deeper than max_json_depth={limit} levels of arrays and objects; "
                         f"raise the limit with omni serve --max-json-depth", param=field, code="json_too_deep")


def parse_json(raw: bytes, *, max_depth: int = MAX_JSON_DEPTH, max_elements: int = MAX_JSON_ELEMENTS) -> Any:
    """The body as JSON, or a 400. A value the parser cannot take (an integer of thousands of digits,
    nesting deeper than ``max_depth``) is reported with the top-level field that holds it.

    ``max_elements`` is checked first with ``bytes.count`` (C speed; brackets and commas inside strings count too,
    which only over-counts): a body of millions of empty arrays is a 413 before ``json.loads`` spends seconds and
    hundreds of MiB on it."""
    if not raw:
        raise invalid("the request body is empty; send a JSON object", None, code="invalid_body")
    if raw.count(b"[") + raw.count(b"{") + raw.count(b",") > max_elements:
        raise json_too_large(max_elements)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise invalid(f"the request body is not valid UTF-8: {exc}", None, code="invalid_json") from None
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError, as is the int digit limit
        field = _failing_field(text)
        if isinstance(exc, RecursionError):
            raise json_too_deep(max_depth, field) from None
        elif isinstance(exc, json.JSONDecodeError):
            reason = f"is not valid JSON: {exc}"
        else:
            reason = f"cannot be read: {exc}"
        where = f"'{field}'" if field else "the request body"
        raise invalid(f"{where} {reason}", field, code="invalid_json") from None
    if _depth(value, max_depth) > max_depth:
        deep = [k for k, v in value.items() if _depth(v, max_depth - 1) >= max_depth] if isinstance(value, dict) else []
        raise json_too_deep(max_depth, deep[0] if deep else None)
    return value


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
_PARAM_OF_FIELD = {"num_outputs_per_prompt": "n", "height": "size", "width": "size", "extra_args": "extra_args",
                   "multi_modal_data.image": "image"}


def config_error(exc: ConfigError, extra: Mapping[str, str] | None = None) -> APIError:
    """A validation error of omni's config/pipeline as a 400 naming the request field the client sent, in the
    message too: a bad ``size`` is reported as ``'size'``, not as ``SamplingParams.height``."""
    field = exc.field
    param = {**_PARAM_OF_FIELD, **(extra or {})}.get(field, field) if field else None
    message = str(exc)
    if field:
        message = message.replace(f"SamplingParams.{field}=", f"{field}=")
    if param and param != field:
        hint = " (WIDTHxHEIGHT)" if param == "size" else ""
        message = f"'{param}'{hint}: {message}"
    return invalid(message, param)


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
    sides = [name for name in ("width", "height") if name in fields]
    if sides:  # vLLM-Omni's clients send separate width and height
        if size is not None:
            raise invalid("give either 'size' or 'width' and 'height', not both", "size")
        if len(sides) == 1:
            missing = ({"width", "height"} - set(sides)).pop()
            raise invalid(f"'{sides[0]}' needs '{missing}' as well (or give 'size': 'WIDTHxHEIGHT')", missing,
                          code="missing_required_parameter")
        size = (fields["width"], fields["height"])
        if min(size) < 1:
            raise invalid(f"width={size[0]} and height={size[1]} must be positive", "width")
    if size is not None:
        kwargs["width"], kwargs["height"] = size
    try:
        return SamplingParams.from_kwargs(**kwargs, **fixed)
    except ConfigError as exc:
        sent = {side: side for side in sides}  # vLLM-Omni's separate width and height are named as sent
        raise config_error(exc, {**{v: k for k, v in names.items()}, **sent}) from None


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
    "partial_images": "int", "step_previews": "bool",
    "negative_prompt": "str", "num_inference_steps": "int", "guidance_scale": "number", "seed": "int",
    "extra_args": "object", "lora": "str", "lora_scale": "number",
}
#: OpenAI's bound on ``partial_images`` (0 to 3 previews before the final image)
MAX_PARTIAL_IMAGES = 3
#: OpenAI fields accepted only at the value this server produces anyway
IMAGE_ACCEPTED_DEFAULTS = {"quality": ("auto", "standard"), "style": ("vivid", "natural"),
                           "background": ("auto", "opaque"), "output_format": ("png",),
                           "moderation": ("auto", "low")}
IMAGE_UNSUPPORTED = {"output_compression": "images are PNG", "svg": "images are PNG"}
#: request field -> SamplingParams keyword (model-declared fields keep their name)
_IMAGE_SAMPLING = {"n": "num_outputs_per_prompt", "num_inference_steps": "num_inference_steps",
                   "guidance_scale": "guidance_scale", "seed": "seed", "extra_args": "extra_args",
                   "lora": "lora", "lora_scale": "lora_scale"}


@attrs.frozen
class ImageRequest:
    prompt: str
    negative_prompt: str | None
    params: SamplingParams
    model: str | None
    stream: bool
    #: input images (PIL), for edit models
    images: tuple = ()
    #: OpenAI's ``partial_images`` (streams only): that many previews spread over the steps before the final image
    partial_images: int = 0
    #: omni's extension ``step_previews`` (streams only): a preview after every denoising step
    step_previews: bool = False

    @property
    def wants_previews(self) -> bool:
        """The engine computes previews for this request only when a stream will send some."""
        return self.stream and (self.partial_images > 0 or self.step_previews)


def _stream_fields(fields: Mapping[str, Any]) -> dict[str, Any]:
    """``partial_images`` (OpenAI's, 0 to 3) and ``step_previews`` (omni's); both shape a stream only."""
    partial = fields.get("partial_images", 0)
    if not 0 <= partial <= MAX_PARTIAL_IMAGES:
        raise invalid(f"'partial_images'={partial} is invalid: allowed values are "
                      f"{', '.join(str(k) for k in range(MAX_PARTIAL_IMAGES + 1))} (previews before the final image; "
                      f"'step_previews': true streams one per denoising step)", "partial_images")
    step = fields.get("step_previews", False)
    if step and partial:
        raise invalid("give either 'partial_images' (OpenAI's: 1 to 3 previews spread over the steps) or "
                      "'step_previews': true (omni's: one per step), not both", "step_previews")
    return {"partial_images": partial, "step_previews": step}


def partial_image_steps(partial_images: int, num_steps: int) -> frozenset[int]:
    """The steps (1-based) after which a stream with ``partial_images`` previews sends them: spread evenly over
    the ``num_steps`` steps, the final image coming after the last step. Fewer when there are fewer steps than
    previews asked for (OpenAI's documentation allows the final image before every partial image)."""
    if partial_images <= 0 or num_steps <= 0:
        return frozenset()
    if num_steps <= partial_images:
        return frozenset(range(1, num_steps + (1 if num_steps == 1 else 0)))
    return frozenset(min(num_steps - 1, max(1, int((i + 1) * num_steps / (partial_images + 1) + 0.5)))
                     for i in range(partial_images))


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
                        model=fields.get("model"), stream=fields.get("stream", False), **_stream_fields(fields))


# ------------------------------------------------------------------------------------------ edits
#: the file fields of ``POST /v1/images/edits``: OpenAI's client sends ``image`` (one file) or ``image[]`` (several)
EDIT_IMAGE_FIELDS = ("image", "image[]")
EDIT_MASK_FIELD = "mask"
#: sent by vLLM-Omni's benchmark client with every edit (``bot_task=think``, a knob of its own models): read
#: as the models here have no such knob
EDIT_IGNORED = ("user", "safety_identifier", "bot_task")


def parse_edit_request(form: Any, *, model_fields: Sequence[Any] | None = None) -> ImageRequest:
    """The text fields of a ``POST /v1/images/edits`` form -> :class:`ImageRequest` (images added by the route).
    The same fields as generations, read from form text."""
    kinds, sampling = _with_model_fields(IMAGE_FIELDS, _IMAGE_SAMPLING, model_fields)
    fields = _read_fields(form, kinds, accepted_defaults=IMAGE_ACCEPTED_DEFAULTS,
                          ignored=EDIT_IGNORED, unsupported=IMAGE_UNSUPPORTED, from_form=True)
    prompt = _prompt(fields)
    fmt = fields.get("response_format", "b64_json")
    if fmt != "b64_json":
        raise invalid(f"'response_format'={fmt!r} is not supported: this server returns images inline, use "
                      f"'b64_json'", "response_format", code="unsupported_value")
    return ImageRequest(prompt=prompt, negative_prompt=fields.get("negative_prompt"), params=_sampling(fields, sampling),
                        model=fields.get("model"), stream=fields.get("stream", False), **_stream_fields(fields))


# ------------------------------------------------------------------------------------------ chat completions
#: generation fields a chat request may carry, at the top level or in ``extra_body`` (vLLM-Omni's image route)
CHAT_GENERATION_FIELDS = {
    "n": "int", "size": "str", "width": "int", "height": "int", "num_inference_steps": "int",
    "guidance_scale": "number", "negative_prompt": "str", "seed": "int", "num_frames": "int", "fps": "int",
    "extra_args": "object", "lora": "str", "lora_scale": "number",
    # vLLM-Omni's spellings: its older chat server read ``num_outputs_per_prompt`` (its text_to_image client sends
    # it in ``extra_body``); its newer protocol calls the model options ``extra_params``
    "num_outputs_per_prompt": "int", "extra_params": "object",
}
#: vLLM-Omni's name -> ours, for fields that mean the same (giving both is a 400)
VLLM_OMNI_ALIASES = {"num_outputs_per_prompt": "n", "extra_params": "extra_args"}
#: chat-completion fields that mean nothing to an image model; read and left alone, as vLLM-Omni does
CHAT_IGNORED = ("user", "temperature", "top_p", "max_tokens", "max_completion_tokens", "frequency_penalty",
                "presence_penalty", "stop", "modalities", "response_format")
_CHAT_SAMPLING = {"n": "num_outputs_per_prompt", "num_inference_steps": "num_inference_steps",
                  "guidance_scale": "guidance_scale", "seed": "seed", "extra_args": "extra_args",
                  "num_frames": "num_frames", "lora": "lora", "lora_scale": "lora_scale"}


@attrs.frozen
class ChatImageRequest:
    request: ImageRequest
    #: the image URLs of the last user message, in order (data URLs)
    image_urls: tuple
    #: frames per second of the MP4 a video model's answer carries
    fps: int = 16


def _aliases(fields: dict[str, Any], aliases: Mapping[str, str]) -> dict[str, Any]:
    """vLLM-Omni's spellings (``num_outputs_per_prompt``, ``extra_params``) read as ours; both is a 400."""
    for theirs, ours in aliases.items():
        if theirs in fields:
            if ours in fields:
                raise invalid(f"give either '{ours}' or '{theirs}' (vLLM-Omni's name for it), not both", theirs)
            fields[ours] = fields.pop(theirs)
    return fields


def parse_chat_request(body: Any, *, model_fields: Sequence[Any] | None = None, video: bool = False
                       ) -> ChatImageRequest:
    """``POST /v1/chat/completions`` (vLLM-Omni's image route, and its older server's video route): the last user
    message is the prompt (its text parts joined; its ``image_url`` parts are input images), generation fields come
    at the top level or in ``extra_body``. ``video``: the served model makes videos (``num_frames`` and ``fps``
    count)."""
    if not isinstance(body, dict):
        raise invalid(f"the request body must be a JSON object, got {type(body).__name__}", None, code="invalid_body")
    body = dict(body)
    extra = body.pop("extra_body", None)
    if extra is not None:
        if not isinstance(extra, dict):
            raise invalid(f"'extra_body' must be a JSON object, got {type(extra).__name__}", "extra_body",
                          code="invalid_type")
        both = sorted(set(extra) & set(body))
        if both:
            raise invalid(f"{both[0]!r} is given both at the top level and in 'extra_body'; give it once", both[0])
        body.update(extra)
    messages = body.pop("messages", None)
    if body.pop("stream", False):
        raise invalid("stream=true is not supported on /v1/chat/completions for image models; use "
                      "POST /v1/images/generations with stream=true for per-step previews", "stream",
                      code="unsupported_value")
    text, urls = _last_user_message(messages)
    kinds, sampling = _with_model_fields({"model": "str", **CHAT_GENERATION_FIELDS}, _CHAT_SAMPLING, model_fields)
    fields = _aliases(_read_fields(body, kinds, ignored=CHAT_IGNORED), VLLM_OMNI_ALIASES)
    fps = fields.pop("fps", DEFAULT_FPS)  # vLLM-Omni's client sends its --fps with image requests too
    if video:
        if not 1 <= fps <= MAX_FPS:
            raise invalid(f"'fps'={fps} is invalid: must be between 1 and {MAX_FPS}", "fps")
    elif fields.get("num_frames") == 1:
        fields.pop("num_frames")
    request = ImageRequest(prompt=text, negative_prompt=fields.get("negative_prompt"),
                           params=_sampling(fields, sampling), model=fields.get("model"), stream=False)
    return ChatImageRequest(request=request, image_urls=tuple(urls), fps=fps)


def _last_user_message(messages: Any) -> tuple[str, list]:
    if not isinstance(messages, list) or not messages:
        raise invalid("'messages' is required: a non-empty list of chat messages; the last user message is the prompt",
                      "messages", code="missing_required_parameter")
    users = [m for m in messages if isinstance(m, dict) and m.get("role") == "user"]
    if not users:
        raise invalid("'messages' has no message with role 'user' (its content is the prompt)", "messages")
    content = users[-1].get("content")
    if isinstance(content, str):
        return content, []
    if not isinstance(content, list):
        raise invalid("a user message's 'content' must be a string or a list of parts", "messages", code="invalid_type")
    texts, urls = [], []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "image_url" and isinstance(part.get("image_url"), (dict, str)):
            url = part["image_url"]
            urls.append(url.get("url") if isinstance(url, dict) else url)
        else:
            raise invalid(f"content part {i} of the last user message must be {{'type': 'text', 'text': ...}} or "
                          f"{{'type': 'image_url', 'image_url': {{'url': 'data:...'}}}}, got {part!r:.80}",
                          "messages", code="invalid_type")
    return " ".join(texts), urls


# ------------------------------------------------------------------------------------------ videos
VIDEO_FIELDS = {
    "prompt": "str", "model": "str", "size": "str", "seconds": "str|number", "num_frames": "int", "fps": "int",
    "negative_prompt": "str", "num_inference_steps": "int", "guidance_scale": "number", "seed": "int",
    "extra_args": "object", "width": "int", "height": "int", "lora": "str", "lora_scale": "number",
    # vLLM-Omni's video protocol: ``extra_params`` is its name for extra_args; ``video_params`` a block of
    # width/height/num_frames/fps (the top-level fields win, as there)
    "extra_params": "object", "video_params": "object",
}
#: vLLM-Omni's video switches accepted at their default (off): this server has no audio or frame interpolation
_OFF = (False, "false", "False")
VIDEO_ACCEPTED_DEFAULTS = {"quality": ("auto", "standard"), "generate_sound": _OFF,
                           "enable_frame_interpolation": _OFF}
_VIDEO_PARAMS_BLOCK = ("width", "height", "num_frames", "fps")
#: the field of ``/v1/videos`` holding the input image of an image-to-video model (a file part, or a data URL)
INPUT_REFERENCE = "input_reference"
VIDEO_UNSUPPORTED = {"remixed_from_video_id": "remixing is not supported"}
_VIDEO_SAMPLING = {"num_frames": "num_frames", "num_inference_steps": "num_inference_steps",
                   "guidance_scale": "guidance_scale", "seed": "seed", "extra_args": "extra_args",
                   "lora": "lora", "lora_scale": "lora_scale"}
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
                          accepted_defaults=VIDEO_ACCEPTED_DEFAULTS, from_form=from_form)
    fields = _aliases(fields, {"extra_params": "extra_args"})
    block = fields.pop("video_params", None)
    if block is not None:
        unknown = sorted(set(block) - set(_VIDEO_PARAMS_BLOCK))
        if unknown:
            raise invalid(f"'video_params' has unknown key '{unknown[0]}'; allowed: {', '.join(_VIDEO_PARAMS_BLOCK)}",
                          "video_params", code="unknown_parameter")
        for name in _VIDEO_PARAMS_BLOCK:
            if block.get(name) is not None and name not in fields:
                fields[name] = _check(f"video_params.{name}", block[name], "int")
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


#: default of ``omni serve --max-form-parts``: an edit is a few images and about twenty fields
MAX_FORM_PARTS = 64


def too_many_parts(limit: int) -> APIError:
    return APIError(413, f"the form has more than max_form_parts={limit} parts (fields and files); send fewer, or "
                         f"raise the limit with omni serve --max-form-parts", code="too_many_form_parts")


def parse_form(body: bytes, content_type: str) -> dict[str, Any]:
    """Fields of a ``multipart/form-data`` body, a file part as ``bytes`` (refused by the field checks where a
    route expects text); the last part of a repeated name wins. See :func:`parse_multipart` for files."""
    fields, files = parse_multipart(body, content_type)
    return {**fields, **{name: parts[-1] for name, parts in files.items()}}


def parse_urlencoded(body: bytes, max_fields: int = MAX_FORM_PARTS) -> dict[str, str]:
    """Fields of an ``application/x-www-form-urlencoded`` body (what aiohttp and vLLM-Omni's benchmark send for a
    form without files); a repeated name is refused, naming it; more than ``max_fields`` fields is a 413."""
    from urllib.parse import parse_qsl

    if body.count(b"&") + body.count(b";") >= max_fields:
        raise too_many_parts(max_fields)
    try:
        pairs = parse_qsl(body.decode("utf-8"), keep_blank_values=True, strict_parsing=bool(body.strip()))
    except UnicodeDecodeError as exc:
        raise invalid(f"the form body is not valid UTF-8: {exc}", None, code="invalid_body") from None
    except ValueError as exc:
        raise invalid(f"malformed application/x-www-form-urlencoded body: {exc}", None, code="invalid_body") from None
    fields: dict[str, str] = {}
    for name, value in pairs:
        if name in fields:
            raise invalid(f"form field '{name}' is given more than once", name, code="invalid_body")
        fields[name] = value
    return fields


#: bytes searched per C call while splitting a form: one ``find`` over 32 MiB holds the GIL (so the event loop) for
#: up to 80 ms; between windows the parsing thread lets the loop run
_WINDOW = 1 << 20


def _find(body: bytes, sub: bytes, start: int, end: int | None = None) -> int:
    """``body.find(sub, start, end)``, one window at a time."""
    end = len(body) if end is None else end
    while start < end:
        stop = min(start + _WINDOW, end)
        i = body.find(sub, start, min(stop + len(sub) - 1, end))
        if i >= 0:
            return i
        start = stop
    return -1


def _count(body: bytes, sub: bytes) -> int:
    """``body.count(sub)``, one window at a time (each occurrence counted in the window it starts in)."""
    return sum(body.count(sub, start, start + _WINDOW + len(sub) - 1) for start in range(0, len(body), _WINDOW))


def _malformed(why: str) -> APIError:
    return invalid(f"malformed multipart/form-data body: {why}", None, code="invalid_body")


def parse_multipart(body: bytes, content_type: str, max_parts: int = MAX_FORM_PARTS
                    ) -> tuple[dict[str, str], dict[str, list[bytes]]]:
    """``(text fields, file parts by name)`` of a ``multipart/form-data`` body (what the ``openai`` client sends to
    ``/v1/videos`` and ``/v1/images/edits``); a name may carry several files (``image[]``).

    The body is split at its boundary with ``bytes`` methods (C speed, no line-by-line pass over a file's bytes,
    which made the standard library's MIME parser take seconds and hundreds of MiB on a body of short lines);
    only each part's few header lines go through ``email``'s header parser. The boundaries are counted first, so
    a body of more than ``max_parts`` parts is a 413 before any part is parsed.
    """
    from email.message import Message

    header = Message()
    header["content-type"] = content_type
    boundary = header.get_param("boundary")
    if not isinstance(boundary, str) or not boundary:
        raise _malformed("the Content-Type has no boundary")
    delimiter = b"\r\n--" + boundary.encode("latin-1")
    first = delimiter[2:]
    if _count(body, delimiter) + body.startswith(first) - 1 > max_parts:
        raise too_many_parts(max_parts)
    pos = 0 if body.startswith(first) else _find(body, delimiter, 0)  # after a preamble, if any
    if pos < 0:
        raise _malformed(f"no boundary '--{boundary}'")
    pos += len(first) if pos == 0 else len(delimiter)
    fields: dict[str, Any] = {}
    files: dict[str, list[bytes]] = {}
    while not body.startswith(b"--", pos):  # "--boundary--" closes the body
        end = _find(body, delimiter, pos)
        if end < 0:
            raise _malformed(f"no closing boundary '--{boundary}--'")
        line_end = body.find(b"\r\n", pos, end + 2)
        if line_end < 0 or body[pos:line_end].strip(b" \t"):
            raise _malformed("a boundary line is followed by text")
        blank = body.find(b"\r\n\r\n", line_end, end + 2)
        if blank < 0:
            raise _malformed("a part has no blank line after its headers")
        _add_part(body[line_end + 2:blank + 2], body[blank + 4:end], fields, files)  # one copy of the payload
        pos = end + len(delimiter)
    return fields, files


def _add_part(head: bytes, payload: bytes, fields: dict[str, Any], files: dict[str, list[bytes]]) -> None:
    """One part (its header block, its bytes) into ``fields`` or ``files``."""
    from email.parser import BytesHeaderParser
    from email.policy import HTTP
    from email.utils import collapse_rfc2231_value

    part = BytesHeaderParser(policy=HTTP).parsebytes(head + b"\r\n")
    name = part.get_param("name", header="content-disposition")
    if not name:
        return
    name = collapse_rfc2231_value(name)
    encoding = str(part.get("content-transfer-encoding", "")).strip().lower()
    if encoding in ("base64", "quoted-printable"):  # deprecated in forms (RFC 7578) but legal
        import binascii
        import quopri

        try:
            payload = binascii.a2b_base64(payload) if encoding == "base64" else quopri.decodestring(payload)
        except ValueError:
            raise invalid(f"form part '{name}' is not valid {encoding}", name, code="invalid_body") from None
    if part.get_filename() is not None:
        files.setdefault(name, []).append(payload)
        return
    charset = part.get_content_charset() or "utf-8"
    try:
        fields[name] = payload.decode(charset)
    except LookupError:
        raise invalid(f"form field '{name}' has an unknown charset {charset!r}; send UTF-8", name,
                      code="invalid_body") from None
    except UnicodeDecodeError as exc:
        raise invalid(f"form field '{name}' is not valid {charset}: {exc}", name, code="invalid_body") from None


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
                       accepted_defaults=VIDEO_ACCEPTED_DEFAULTS, ignored=("user",))


# ------------------------------------------------------------------------------------------ scheduling
#: what every generation route takes for scheduling (docs/scheduling.md): ``priority`` (lower runs first) and
#: ``timeout`` (seconds; past it the request ends with a 504); kept apart so other agents' fields are not reordered
SCHEDULING_FIELDS = {"priority": "int", "timeout": "number"}
for _fields, _names in ((IMAGE_FIELDS, _IMAGE_SAMPLING), (CHAT_GENERATION_FIELDS, _CHAT_SAMPLING),
                        (VIDEO_FIELDS, _VIDEO_SAMPLING)):
    _fields.update(SCHEDULING_FIELDS)
    _names.update({name: name for name in SCHEDULING_FIELDS})
#: the request header that sets a deadline too (seconds, as the ``timeout`` field; the smaller of both applies)
TIMEOUT_HEADER = "X-Request-Timeout"


def with_timeout_header(params: SamplingParams, headers: Mapping[str, str]) -> SamplingParams:
    """``params`` with the ``X-Request-Timeout`` header's deadline applied (a 400 naming the header if it is not a
    number of seconds in the field's range); with both the header and the ``timeout`` field, the smaller wins."""
    raw = headers.get(TIMEOUT_HEADER.lower(), headers.get(TIMEOUT_HEADER))
    if raw is None:
        return params
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise invalid(f"the {TIMEOUT_HEADER} header must be a number of seconds, got {raw!r:.40}", TIMEOUT_HEADER)
    if params.timeout is not None:
        value = min(value, params.timeout)
    try:
        return params.replace(timeout=value)
    except ConfigError as exc:
        raise invalid(f"the {TIMEOUT_HEADER} header is invalid: {exc}", TIMEOUT_HEADER) from None

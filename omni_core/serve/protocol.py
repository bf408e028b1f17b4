"""The request models of the OpenAI-compatible endpoints: which fields each route takes (the core's, and the
served model's declared sampling fields), and how a checked body becomes a request (no web framework here).

Field checks live in :mod:`omni_core.serve.fields`, errors in :mod:`omni_core.serve.errors`, body parsing in
:mod:`omni_core.serve.bodies`, body schemas in :mod:`omni_core.serve.openapi`. Range checks reuse
:class:`~omni_core.config.SamplingParams` and the pipeline's ``check_sampling_params``.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import attrs

from omni_core.config import SamplingParams
from omni_core.errors import ConfigError
from omni_core.serve.errors import invalid
from omni_core.serve.fields import check_kind, read_fields, required_prompt, sampling_params


# ------------------------------------------------------------------------------------------ model fields
#: body kind of a declared field, from its record's JSON schema (``Option.json_schema``: the one reading of its type)
_KIND_OF_SCHEMA = {"number": "number", "integer": "int", "boolean": "bool", "string": "str"}


def model_field_kinds(model_fields: Sequence[Any] | None) -> dict[str, str]:
    """Body kinds of a model's declared sampling fields (``SamplingField`` records), so a model's knob is a request
    field by declaration alone. The server passes the served pipeline's (``ModelInfo.sampling_fields``); ``None``
    (parsing with no server) takes every registered pipeline's, leaving the pipeline's own check to refuse one it
    does not declare."""
    if model_fields is None:
        from omni_core.config import registered_sampling_fields

        model_fields = [decls[0][1] for decls in registered_sampling_fields().values()]
    return {f.name: _KIND_OF_SCHEMA[f.json_schema()["type"]] for f in model_fields}


def with_model_fields(fields: Mapping[str, str], sampling: Mapping[str, str], model_fields: Sequence[Any] | None
                      ) -> tuple[dict[str, str], dict[str, str]]:
    kinds = {k: v for k, v in model_field_kinds(model_fields).items() if k not in fields}
    return {**fields, **kinds}, {**sampling, **{name: name for name in kinds}}


# ------------------------------------------------------------------------------------------ images
#: the core's body fields (name -> kind); a model's declared sampling fields join them (``model_field_kinds``)
IMAGE_FIELDS = {
    "prompt": "str", "model": "str", "n": "int", "size": "str", "response_format": "str", "stream": "bool",
    "partial_images": "int", "step_previews": "bool",
    "negative_prompt": "str", "num_inference_steps": "int", "guidance_scale": "number", "seed": "int",
    "extra_args": "object", "lora": "str", "lora_scale": "number", "max_sequence_length": "int",
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
                   "lora": "lora", "lora_scale": "lora_scale",
                   "max_sequence_length": "max_sequence_length"}


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
    """The steps (1-based) after which a stream with ``partial_images`` previews sends them
    (:func:`omni_core.request.preview_steps`, which the runner uses to compute only those)."""
    from omni_core.request import preview_steps

    return preview_steps(partial_images, num_steps)


def parse_image_request(body: Any, *, model_fields: Sequence[Any] | None = None) -> ImageRequest:
    """``POST /v1/images/generations`` body -> validated :class:`ImageRequest` (or a 400 naming the field).
    ``model_fields``: the served model's declared sampling fields (None: any registered pipeline's)."""
    kinds, sampling = with_model_fields(IMAGE_FIELDS, _IMAGE_SAMPLING, model_fields)
    fields = read_fields(body, kinds, accepted_defaults=IMAGE_ACCEPTED_DEFAULTS,
                         ignored=("user", "safety_identifier"), unsupported=IMAGE_UNSUPPORTED)
    prompt = required_prompt(fields)
    fmt = fields.get("response_format", "b64_json")
    if fmt != "b64_json":
        raise invalid(f"'response_format'={fmt!r} is not supported: this server returns images inline, use "
                      f"'b64_json'", "response_format", code="unsupported_value")
    params = sampling_params(fields, sampling)
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
    kinds, sampling = with_model_fields(IMAGE_FIELDS, _IMAGE_SAMPLING, model_fields)
    fields = read_fields(form, kinds, accepted_defaults=IMAGE_ACCEPTED_DEFAULTS,
                         ignored=EDIT_IGNORED, unsupported=IMAGE_UNSUPPORTED, from_form=True)
    prompt = required_prompt(fields)
    fmt = fields.get("response_format", "b64_json")
    if fmt != "b64_json":
        raise invalid(f"'response_format'={fmt!r} is not supported: this server returns images inline, use "
                      f"'b64_json'", "response_format", code="unsupported_value")
    return ImageRequest(prompt=prompt, negative_prompt=fields.get("negative_prompt"),
                        params=sampling_params(fields, sampling), model=fields.get("model"),
                        stream=fields.get("stream", False), **_stream_fields(fields))


# ------------------------------------------------------------------------------------------ chat completions
#: generation fields a chat request may carry, at the top level or in ``extra_body`` (vLLM-Omni's image route)
CHAT_GENERATION_FIELDS = {
    "n": "int", "size": "str", "width": "int", "height": "int", "num_inference_steps": "int",
    "guidance_scale": "number", "negative_prompt": "str", "seed": "int", "num_frames": "int", "fps": "int",
    "extra_args": "object", "lora": "str", "lora_scale": "number", "max_sequence_length": "int",
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
                  "num_frames": "num_frames", "lora": "lora", "lora_scale": "lora_scale",
                   "max_sequence_length": "max_sequence_length"}


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


def _model_fields_in_extra(fields: dict[str, Any], kinds: Mapping[str, str], core: Mapping[str, str]
                           ) -> dict[str, Any]:
    """vLLM-Omni hands ``extra_params`` to the model as is: a key of it (here ``extra_args``) that the served model
    declares as a sampling field (Wan's ``sample_solver``) is read as that field; given both ways, a 400."""
    extra = fields.get("extra_args")
    declared = [name for name in extra or () if name in kinds and name not in core]
    for name in declared:
        if name in fields:
            raise invalid(f"'{name}' is given both at the top level and in 'extra_params'; give it once", name)
        fields[name] = check_kind(f"extra_params.{name}", extra[name], kinds[name])
    if declared:
        fields["extra_args"] = {k: v for k, v in extra.items() if k not in declared}
    return fields


def parse_chat_request(body: Any, *, model_fields: Sequence[Any] | None = None, video: bool = False,
                       fps_field: str | None = None) -> ChatImageRequest:
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
    kinds, sampling = with_model_fields({"model": "str", **CHAT_GENERATION_FIELDS}, _CHAT_SAMPLING, model_fields)
    fields = _aliases(read_fields(body, kinds, ignored=CHAT_IGNORED), VLLM_OMNI_ALIASES)
    fields = _model_fields_in_extra(fields, kinds, CHAT_GENERATION_FIELDS)
    fixed: dict[str, Any] = {}
    if video:
        fps, fixed = video_fps(fields, fps_field, model_fields)
        fields.pop("fps", None)
    else:
        fps = fields.pop("fps", DEFAULT_FPS)  # vLLM-Omni's client sends its --fps with image requests too
        if fields.get("num_frames") == 1:
            fields.pop("num_frames")
    request = ImageRequest(prompt=text, negative_prompt=fields.get("negative_prompt"),
                           params=sampling_params(fields, sampling, **fixed), model=fields.get("model"), stream=False)
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
#: the field of ``/v1/videos`` holding the input image of an image-to-video model (a file part, or a data URL)
INPUT_REFERENCE = "input_reference"
#: vLLM-Omni's JSON-safe alternative to it: ``{"image_url": ...}`` (``{"file_id": ...}`` is refused, as there)
IMAGE_REFERENCE = "image_reference"
VIDEO_FIELDS = {
    "prompt": "str", "model": "str", "size": "str", "seconds": "str|number", "num_frames": "int", "fps": "int",
    "negative_prompt": "str", "num_inference_steps": "int", "guidance_scale": "number", "seed": "int",
    "extra_args": "object", "width": "int", "height": "int", "lora": "str", "lora_scale": "number",
    "max_sequence_length": "int",
    # vLLM-Omni's video protocol: ``extra_params`` is its name for extra_args; ``video_params`` a block of
    # width/height/num_frames/fps (the top-level fields win, as there); ``image_reference`` the input image as
    # ``{"image_url": "data:..."}`` (JSON text in a form)
    "extra_params": "object", "video_params": "object", IMAGE_REFERENCE: "object",
}
#: vLLM-Omni's video switches accepted at their default (off): this server has no audio or frame interpolation
_OFF = (False, "false", "False")
VIDEO_ACCEPTED_DEFAULTS = {"quality": ("auto", "standard"), "generate_sound": _OFF,
                           "enable_frame_interpolation": _OFF}
_VIDEO_PARAMS_BLOCK = ("width", "height", "num_frames", "fps")
VIDEO_UNSUPPORTED = {"remixed_from_video_id": "remixing is not supported"}
_VIDEO_SAMPLING = {"num_frames": "num_frames", "num_inference_steps": "num_inference_steps",
                   "guidance_scale": "guidance_scale", "seed": "seed", "extra_args": "extra_args",
                   "lora": "lora", "lora_scale": "lora_scale",
                   "max_sequence_length": "max_sequence_length"}
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
    #: the data URL of vLLM-Omni's ``image_reference`` (the input image), or None
    image_reference: str | None = None


def video_fps(fields: dict[str, Any], fps_field: str | None, model_fields: Sequence[Any] | None
              ) -> tuple[int | float, dict[str, Any]]:
    """The rate a video's frames play at, and the sampling field it sets: a model whose frames have a rate of their
    own (``fps_field``, LTX-2's ``frame_rate``) takes ``fps`` as that field (default: the field's default); for
    the others ``fps`` only says how the file is written (default 16)."""
    fps, fixed = fields.get("fps"), {}
    if fps_field is not None:
        own = fields.get(fps_field)
        if fps is not None and own is not None and fps != own:
            raise invalid(f"'fps'={fps} and '{fps_field}'={own} disagree: this model's frames play at its "
                          f"{fps_field}; give one of them", "fps")
        if fps is None:
            fps = own if own is not None else next(
                (f.default for f in model_fields or () if f.name == fps_field and f.default), None)
        if own is None and fps is not None:
            fixed[fps_field] = fps
    fps = DEFAULT_FPS if fps is None else fps
    if not 1 <= fps <= MAX_FPS:
        raise invalid(f"'fps'={fps} is invalid: must be between 1 and {MAX_FPS}", "fps")
    return fps, fixed


def frames_for_seconds(seconds: float, fps: int, frame_multiple: int) -> int:
    """The frame count closest to ``seconds`` at ``fps`` that the model accepts (``(n - 1) % multiple == 0``)."""
    target = max(1.0, seconds * fps)
    k = max(0, math.floor((target - 1) / frame_multiple + 0.5))  # half rounds up
    return k * frame_multiple + 1


def parse_video_request(body: Any, *, frame_multiple: int = 1, from_form: bool = False,
                        model_fields: Sequence[Any] | None = None, fps_field: str | None = None) -> VideoRequest:
    """``POST /v1/videos`` body (JSON or form fields) -> validated :class:`VideoRequest`; ``model_fields`` as in
    :func:`parse_image_request`, ``fps_field`` as in :func:`video_fps`."""
    kinds, sampling = with_model_fields(VIDEO_FIELDS, _VIDEO_SAMPLING, model_fields)
    fields = read_fields(body, kinds, ignored=("user",), unsupported=VIDEO_UNSUPPORTED,
                         accepted_defaults=VIDEO_ACCEPTED_DEFAULTS, from_form=from_form)
    fields = _model_fields_in_extra(_aliases(fields, {"extra_params": "extra_args"}), kinds, VIDEO_FIELDS)
    reference = _image_reference(fields.pop(IMAGE_REFERENCE, None))
    block = fields.pop("video_params", None)
    if block is not None:
        unknown = sorted(set(block) - set(_VIDEO_PARAMS_BLOCK))
        if unknown:
            raise invalid(f"'video_params' has unknown key '{unknown[0]}'; allowed: {', '.join(_VIDEO_PARAMS_BLOCK)}",
                          "video_params", code="unknown_parameter")
        for name in _VIDEO_PARAMS_BLOCK:
            if block.get(name) is not None and name not in fields:
                fields[name] = check_kind(f"video_params.{name}", block[name], "int")
    prompt = required_prompt(fields)
    fps, fixed = video_fps(fields, fps_field, model_fields)
    seconds = fields.get("seconds")
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
    params = sampling_params(fields, sampling, **fixed)
    return VideoRequest(prompt=prompt, negative_prompt=fields.get("negative_prompt"), params=params,
                        model=fields.get("model"), fps=fps, seconds=seconds, image_reference=reference)


def _image_reference(value: dict | None) -> str | None:
    """vLLM-Omni's ``image_reference`` -> its ``image_url`` (read as a data URL by the route)."""
    if value is None:
        return None
    if set(value) == {"file_id"}:
        raise invalid(f"'{IMAGE_REFERENCE}': file_id is not supported (no file store); give "
                      f"{{'image_url': 'data:image/png;base64,...'}} or the file as '{INPUT_REFERENCE}'",
                      IMAGE_REFERENCE, code="unsupported_value")
    if set(value) != {"image_url"} or not isinstance(value["image_url"], str):
        raise invalid(f"'{IMAGE_REFERENCE}' must be {{'image_url': 'data:image/png;base64,...'}}, got {value!r:.80}",
                      IMAGE_REFERENCE, code="invalid_type")
    return value["image_url"]


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

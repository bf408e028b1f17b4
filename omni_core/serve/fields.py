"""Reading a request's fields: each one type-checked as the kind it is declared (JSON, or text read from a
form), unknown ones refused by name, and the checked fields made into :class:`~omni_core.config.SamplingParams`
(whose ``ConfigError`` is answered naming the field the client sent). The request models in
:mod:`omni_core.serve.protocol` declare which fields a route takes."""

from __future__ import annotations

import json
import math
import numbers
import re
from typing import Any, Mapping

from omni_core.config import SamplingParams
from omni_core.errors import ConfigError
from omni_core.serve.bodies import json_depth
from omni_core.serve.errors import config_error, invalid

#: deepest nesting accepted inside a field (``extra_args``); deeper objects are refused, naming the field
MAX_NESTING = 32
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


def check_kind(name: str, value: Any, kind: str) -> Any:
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
    if kind == "object" and json_depth(value, MAX_NESTING) > MAX_NESTING:
        raise invalid(f"'{name}' is nested too deeply: at most {MAX_NESTING} levels of objects and arrays", name)
    return value


def read_fields(body: Any, fields: Mapping[str, str], *, accepted_defaults: Mapping[str, tuple] = (),
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
        out[name] = check_kind(name, value, fields[name])
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


def required_prompt(fields: dict[str, Any]) -> str:
    prompt = fields.get("prompt")
    if prompt is None:
        raise invalid("'prompt' is required", "prompt", code="missing_required_parameter")
    return prompt  # empty or too long: the engine refuses it (same words as the Python API)


def sampling_params(fields: dict[str, Any], names: Mapping[str, str], **fixed: Any) -> SamplingParams:
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


def _declared_elsewhere(name: str) -> str:
    """`` (a sampling field of X, Y)`` when other installed pipelines declare ``name``, else ``""``."""
    from omni_core.config import registered_sampling_fields

    owners = [pipeline for pipeline, _ in registered_sampling_fields().get(name, [])]
    return f" (it is a sampling field of {', '.join(owners)}, not of the served model)" if owners else ""

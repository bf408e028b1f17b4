"""The OpenAPI document: shared error docs for the routes, and the schema FastAPI makes, made true
(no 422: validation errors are answered 400; bearer auth declared when a key is set)."""

from __future__ import annotations

import warnings
from typing import Any, Mapping, Sequence

from omni_core.serve.protocol import (IMAGE_ACCEPTED_DEFAULTS, IMAGE_FIELDS, VIDEO_ACCEPTED_DEFAULTS, VIDEO_FIELDS,
                                      with_model_fields)

#: routes that need no API key (probes and scrapers)
OPEN_PATHS = ("/health", "/metrics")

ERROR_SCHEMA = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
STATUS_DOC = {400: "invalid request: `param` names the field", 401: "missing or incorrect API key",
              404: "unknown model, video or route", 409: "the video is not ready",
              413: "the request body is larger than --max-body-bytes (--max-upload-bytes where images are sent)",
              429: "the queue (or the video table) is full; see Retry-After",
              500: "the generation failed", 503: "the engine is dead, closed, or the server is shutting down"}


# ------------------------------------------------------------------------------------------ request bodies
_SCHEMA_OF_KIND = {"str": {"type": "string"}, "int": {"type": "integer"}, "number": {"type": "number"},
                   "bool": {"type": "boolean"}, "object": {"type": "object"},
                   "str|number": {"type": ["string", "number"]}}


def body_schema(fields: Mapping[str, str], *, accepted_defaults: Mapping[str, tuple] = (),
                ignored: tuple[str, ...] = ()) -> dict[str, Any]:
    """The JSON schema of a request body read by :func:`~omni_core.serve.fields.read_fields` (for
    ``/openapi.json``): the same fields, kinds and accepted values, ``prompt`` required, nothing else allowed.
    ``null`` means "the default"."""
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


def _declared_schemas(schema: dict[str, Any], core: Mapping[str, str], model_fields: Sequence[Any] | None
                      ) -> dict[str, Any]:
    """Each declared sampling field documented by its record's own JSON schema (bounds, choices, default, help;
    ``Option.json_schema``), ``null`` added: it means "the model's default"."""
    if model_fields is None:
        from omni_core.config import registered_sampling_fields

        model_fields = [decls[0][1] for decls in registered_sampling_fields().values()]
    for field in model_fields:
        if field.name not in core:
            prop = field.json_schema()
            prop["type"] = [prop["type"], "null"]
            if "enum" in prop:
                prop["enum"] = [*prop["enum"], None]
            schema["properties"][field.name] = prop
    return schema


def image_body_schema(model_fields: Sequence[Any] | None = None) -> dict[str, Any]:
    return _declared_schemas(body_schema(with_model_fields(IMAGE_FIELDS, {}, model_fields)[0],
                                         accepted_defaults=IMAGE_ACCEPTED_DEFAULTS,
                                         ignored=("user", "safety_identifier")), IMAGE_FIELDS, model_fields)


def video_body_schema(model_fields: Sequence[Any] | None = None) -> dict[str, Any]:
    return _declared_schemas(body_schema(with_model_fields(VIDEO_FIELDS, {}, model_fields)[0],
                                         accepted_defaults=VIDEO_ACCEPTED_DEFAULTS, ignored=("user",)),
                             VIDEO_FIELDS, model_fields)


def error_doc(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": ERROR_SCHEMA}}}


def error_docs(*statuses: int) -> dict[int, Any]:
    return {status: error_doc(STATUS_DOC[status]) for status in statuses}


def form_schema(json_schema: dict[str, Any]) -> dict[str, Any]:
    """A JSON body schema as multipart form fields (every form value is text)."""
    return {"type": "object", "required": json_schema["required"],
            "properties": {name: {"type": "string"} for name in json_schema["properties"]}}


def edit_form_schema(model_fields: tuple | None = None) -> dict[str, Any]:
    """The multipart form of ``POST /v1/images/edits``: the generation fields as text, the image file(s), a mask."""
    schema = form_schema(image_body_schema(model_fields))
    binary = {"type": "string", "format": "binary"}
    schema["properties"].update({"image": binary, "image[]": {"type": "array", "items": binary}, "mask": binary})
    return schema


def model_request_bodies(model_fields: tuple) -> dict[str, dict[str, Any]]:
    """``{path: {content type: schema}}`` of the POST bodies, with the served model's declared sampling fields
    (the routes state the core's fields only, at import, before any model is known)."""
    video = video_body_schema(model_fields)
    form = form_schema(video)
    form["properties"]["input_reference"] = {"type": "string", "format": "binary"}
    return {"/v1/images/generations": {"application/json": image_body_schema(model_fields)},
            "/v1/images/edits": {"multipart/form-data": edit_form_schema(model_fields)},
            "/v1/videos": {"application/json": video, "multipart/form-data": form,
                           "application/x-www-form-urlencoded": form_schema(video)}}


def install_openapi(app: Any, api_key: str | None, model_fields: tuple = ()) -> None:
    """Replace ``app.openapi`` with the corrected schema (built once, on first use); ``model_fields``: the served
    model's sampling fields, documented as body fields."""
    from fastapi.openapi.utils import get_openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            with warnings.catch_warnings():  # GET and HEAD /health share a function: ids are made unique below
                warnings.filterwarnings("ignore", message="Duplicate Operation ID")
                schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                     routes=app.routes)
            for path, bodies in model_request_bodies(model_fields).items():
                content = schema["paths"].get(path, {}).get("post", {}).get("requestBody", {}).get("content", {})
                for content_type, body in bodies.items():
                    if content_type in content:
                        content[content_type]["schema"] = body
            for path, item in schema["paths"].items():
                for method, operation in item.items():
                    if method == "head":
                        operation["operationId"] = operation.get("operationId", path) + "_head"
                    responses = operation.setdefault("responses", {})
                    if responses.pop("422", None) is not None:
                        responses.setdefault("400", error_doc("a parameter is invalid"))
                    if api_key is not None and path not in OPEN_PATHS:
                        operation["security"] = [{"bearer": []}]
                        responses.setdefault("401", error_doc("missing or incorrect API key"))
            components = schema.setdefault("components", {})
            for name in ("HTTPValidationError", "ValidationError"):
                components.get("schemas", {}).pop(name, None)
            components.setdefault("schemas", {})["Error"] = ERROR_SCHEMA
            if api_key is not None:
                components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi

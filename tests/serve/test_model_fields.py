"""A model-declared sampling field over HTTP: the tiny DiT declares ``context_scale`` on its record and a server of
that model takes it in the body, documents it in ``/openapi.json`` and validates it; a server of a model without it
neither documents nor takes it."""

from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture(scope="module")
def tiny_dit_server(tiny_dit_model, start_server):
    return start_server(tiny_dit_model, {"max_num_seqs": 4})


def test_a_declared_field_is_a_body_field(tiny_dit_server, decode_png):
    body = {"prompt": "a red square", "seed": 3, "num_inference_steps": 3}
    with tiny_dit_server.client() as c:
        schema = c.get("/openapi.json").json()
        image_body = schema["paths"]["/v1/images/generations"]["post"]["requestBody"]["content"]["application/json"]
        from omni_core.testing.tiny_dit_plugin import CONTEXT_SCALE

        # documented by the record's own schema (bounds, default, help), null meaning the model's default
        assert image_body["schema"]["properties"]["context_scale"] == {
            **CONTEXT_SCALE.json_schema(), "type": ["number", "null"]}
        assert image_body["schema"]["properties"]["context_scale"]["maximum"] == CONTEXT_SCALE.max
        default, same, scaled = (c.post("/v1/images/generations", json={**body, **extra}) for extra in
                                 ({}, {"context_scale": 1.0}, {"context_scale": 3.0}))
        assert default.status_code == same.status_code == scaled.status_code == 200, scaled.text
        image = [decode_png(r.json()["data"][0]["b64_json"]) for r in (default, same, scaled)]
        assert np.array_equal(image[0], image[1]) and not np.array_equal(image[0], image[2])
        for value, code in [(9.0, "invalid_value"), ("big", "invalid_type")]:
            r = c.post("/v1/images/generations", json={**body, "context_scale": value})
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == "context_scale" and err["code"] == code, r.text


def test_a_model_without_the_field_refuses_it_naming_it(server, tiny_dit_model):
    before = server.engine.stats()["requests_added"]
    with server.client() as c:
        r = c.post("/v1/images/generations", json={"prompt": "x", "context_scale": 2.0})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "context_scale", r.text
    # refused by the served model's own body fields, with the model that does declare it named
    assert err["code"] == "unknown_parameter" and "a sampling field of OmniTinyDiTPipeline" in err["message"]
    with server.client() as c:
        schema = c.get("/openapi.json").json()
    image_body = schema["paths"]["/v1/images/generations"]["post"]["requestBody"]["content"]["application/json"]
    assert "context_scale" not in image_body["schema"]["properties"]  # documented only where it is taken
    assert server.engine.stats()["requests_added"] == before

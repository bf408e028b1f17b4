"""A bounded schema-driven fuzz run (schemathesis) over a live server: every operation ``/openapi.json``
documents, with generated valid and invalid inputs, answers with a status the schema documents and no 5xx."""

from __future__ import annotations

import os
import time

import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402  (hypothesis comes with schemathesis)
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis.checks import content_type_conformance, not_a_server_error, status_code_conformance  # noqa: E402

API_KEY = "fuzz-key"
#: per operation and mode: about 500 requests in all (OMNI_FUZZ_EXAMPLES=500 for a deeper run by hand)
EXAMPLES = int(os.environ.get("OMNI_FUZZ_EXAMPLES", "25"))
TIME_BOUND_S = 240.0 * max(1, EXAMPLES // 25)


@pytest.fixture
def hypothesis_home(tmp_path):
    """Hypothesis keeps constants and caches in ``.hypothesis`` under the working directory: use a temp dir."""
    from hypothesis import configuration

    configuration.set_hypothesis_home_dir(str(tmp_path / "hypothesis"))
    yield
    configuration.set_hypothesis_home_dir(None)


def test_schema_fuzz_finds_no_server_error_and_no_undocumented_status(tiny_model, start_server, hypothesis_home):
    import httpx

    # small limits keep a generated request cheap (the tiny model at <= 32x32, <= 4 steps, <= 2 images)
    live = start_server(tiny_model, {"streaming_output": True, "max_num_seqs": 4,
                                     "limits": {"max_steps": 4, "max_outputs": 2, "max_pixels": 32 * 32}},
                        api_key=API_KEY)
    auth = {"Authorization": f"Bearer {API_KEY}"}
    raw = httpx.get(f"{live.url}/openapi.json", headers=auth).json()
    schema = schemathesis.openapi.from_dict(raw)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {f"{op.method.upper()} {op.path}" for op in operations} >= {
        "POST /v1/images/generations", "POST /v1/videos", "GET /v1/models", "GET /health", "GET /metrics",
        "GET /v1/videos/{video_id}", "DELETE /v1/videos/{video_id}"}
    checks = [not_a_server_error, status_code_conformance, content_type_conformance]
    start = time.monotonic()
    seen: dict[str, set[int]] = {}
    for op in operations:
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                      phases=[Phase.generate], suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(generation_mode=mode))
            def run(case) -> None:
                response = case.call(base_url=live.url, headers=auth, timeout=60)
                seen.setdefault(f"{op.method.upper()} {op.path}", set()).add(response.status_code)
                case.validate_response(response, checks=checks)

            try:
                run()
            except Unsatisfiable:  # no input to make invalid (an operation without parameters or body)
                assert mode is schemathesis.GenerationMode.NEGATIVE
            assert time.monotonic() - start < TIME_BOUND_S, "the fuzz run is too slow for the suite"
    print(f"[fuzz] {sum(map(len, seen.values()))} distinct (operation, status) pairs in "
          f"{time.monotonic() - start:.1f} s: {dict(sorted((k, sorted(v)) for k, v in seen.items()))}")
    # the run really exercised the server: generations succeeded and bad input was refused
    assert {200, 400} <= seen["POST /v1/images/generations"]
    assert 400 in seen["POST /v1/videos"]
    assert live.engine.stats()["requests_failed"] == 0

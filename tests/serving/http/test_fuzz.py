"""No input produces a 500: schemathesis over the app's OpenAPI schema, and hypothesis-made chat bodies; and
the server conforms to its schema: schemathesis `--checks all` finds no failure.

Bounded (a few thousand requests in all) against the fake backend; every non-2xx answer must be OpenAI error
JSON. TestClient re-raises server exceptions, so an unhandled error fails the test with its traceback.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.serving.conftest import ALICE, MODEL, live_server, make_stack

# schemathesis makes one item per operation, all with one node id, which pytest-xdist cannot tell apart (it
# would run one of them): scripts/test.sh runs the `serial` tests in one process after the workers' share
pytestmark = pytest.mark.serial

_STACK = make_stack(Path(tempfile.mkdtemp(prefix="kvmem-fuzz-")), auth=False)
_STACK.store.add("demo", texts=["demo likes tea", "demo has a dog"])
schema = schemathesis.openapi.from_asgi("/openapi.json", _STACK.app)


def assert_openai_error_or_ok(status: int, body: bytes, content_type: str) -> None:
    assert status < 500, (status, body[:500])
    if status >= 400:
        error = json.loads(body)["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert isinstance(error["message"], str) and error["message"]
    if content_type.startswith("application/json"):
        json.loads(body)


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_openapi_fuzz_no_server_error(case) -> None:
    response = case.call()
    content_type = response.headers.get("content-type") or [""]  # schemathesis: header -> list of values
    assert_openai_error_or_ok(response.status_code, response.content, content_type[0])


json_leaf = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
json_value = st.recursive(
    json_leaf,
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
    max_leaves=8,
)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "developer", "tool", ""]) | json_value},
    optional={"content": st.text(max_size=60) | json_value, "name": json_value},
)
chat_body = st.fixed_dictionaries(
    {},
    optional={
        "model": st.sampled_from([MODEL, "gpt-4o", ""]) | json_value,
        "messages": st.lists(message, max_size=4) | json_value,
        "temperature": st.floats(-1, 3) | json_value,
        "top_p": st.floats(-1, 2) | json_value,
        "max_tokens": st.integers(-5, 5000) | json_value,
        "max_completion_tokens": st.integers(-5, 50) | json_value,
        "stop": st.lists(st.text(max_size=3), max_size=6) | st.text(max_size=3) | json_value,
        "seed": st.integers(-(2**70), 2**70) | json_value,
        "n": st.integers(-2, 3) | json_value,
        "stream": st.booleans() | json_value,
        "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans() | json_value}),
        "user": st.sampled_from(["alice", "bob", ""]) | json_value,
    },
)


def test_chat_bodies_fuzz(tmp_path_factory) -> None:
    stack = make_stack(tmp_path_factory.mktemp("fuzz-chat"))
    stack.store.add("alice", texts=["alice likes tea", "alice has a cat"])
    with TestClient(stack.app) as client:

        @given(body=chat_body | json_value)
        @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
        def check(body: object) -> None:
            r = client.post("/v1/chat/completions", json=body, headers=ALICE)
            assert_openai_error_or_ok(r.status_code, r.content, r.headers.get("content-type", ""))
            if r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"):
                assert r.text.endswith("data: [DONE]\n\n")

        check()
    stack.scheduler.stop()


REPO = Path(__file__).resolve().parents[3]


def test_openapi_conformance_checks_all(tmp_path: Path) -> None:
    """`schemathesis run --checks all` over a live loopback server finds no failure: no 5xx, every answer's
    status, content type, headers and body as the schema documents, schema-valid requests accepted and
    schema-invalid ones refused, 405 with `Allow` for a method a path does not take. The rules across fields,
    headers or requests that a schema cannot state are applied to each generated request by
    schemathesis_hooks.py. A fixed seed, so a failure reproduces with the command in the output."""
    (tmp_path / "data").mkdir()
    stack = make_stack(tmp_path / "data", auth=False)
    stack.store.add("demo", texts=["demo likes tea", "demo has a dog"])
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "SCHEMATHESIS_HOOKS": "tests.serving.http.schemathesis_hooks",
    }
    try:
        with live_server(stack.app) as url:
            run = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "schemathesis.cli",
                    "run",
                    f"{url}/openapi.json",
                    "--checks=all",
                    "--workers=1",
                    "--max-examples=25",
                    "--seed=42",
                    "--continue-on-failure",
                    "--suppress-health-check=all",
                    "--output-sanitize=false",
                ],
                cwd=tmp_path,  # its .hypothesis and .schemathesis folders
                env=env,
                capture_output=True,
                text=True,
                timeout=900,
            )
    finally:
        stack.scheduler.stop()
    assert run.returncode == 0, run.stdout[-12_000:] + run.stderr[-2_000:]
    assert re.search(r"\b(\d+) generated, \1 passed\b", run.stdout), run.stdout[-2_000:]  # every case ran

"""kvmem.formation.llm: OpenAIExtractor against a scripted OpenAI-compatible server on 127.0.0.1 (a
ThreadingHTTPServer on port 0, shut down after each test): valid, fenced and garbage replies, retries after
a 500, a timeout, a 400, a refused connection; the request's shape; the key never logged."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvmem.formation.base import make_extractor
from kvmem.formation.errors import ExtractionError
from kvmem.formation.llm import OpenAIExtractor
from kvmem.formation.types import Fact, TurnInput

NOW = "2026-11-26T14:41:09.000000Z"  # a Thursday
KEY = "sk-test-secret-123"
TURNS = [
    TurnInput("u1", "user", "I moved to Berlin yesterday!", NOW),
    TurnInput("a1", "assistant", "Congratulations!", NOW),
    TurnInput("u2", "user", "Also I don't drink coffee anymore.", NOW),
]
ITEMS = [
    {
        "text": "I moved to Berlin yesterday",
        "kind": "fact",
        "subject": "user",
        "attribute": "home city",
        "value": "Berlin",
        "date": "2026-11-25",
    },
    {
        "text": "I don't drink coffee anymore",
        "kind": "preference",
        "subject": "I",
        "attribute": "likes:coffee",
        "value": "no",
        "date": None,
    },
    {"text": "", "kind": "fact", "subject": None, "attribute": None, "value": None, "date": None},
]


def completion(content: str) -> bytes:
    return json.dumps({"choices": [{"message": {"role": "assistant", "content": content}}]}).encode()


@dataclass
class Script:
    replies: list[tuple[int, bytes, float]]  # (status, body, seconds to wait before answering)
    requests: list[tuple[dict, dict]] = field(default_factory=list)  # (headers, json body)


@pytest.fixture
def server() -> Iterator[tuple[str, Script]]:
    script = Script([])

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            script.requests.append((dict(self.headers), body))
            status, payload, delay = script.replies.pop(0) if script.replies else (500, b"{}", 0.0)
            time.sleep(delay)
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up (timeout test)

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/v1", script
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)


def extractor(url: str, **options: object) -> OpenAIExtractor:
    options = {"api_key": KEY, "timeout_s": 2.0, "max_retries": 2, "backoff_s": 0.0, **options}
    return OpenAIExtractor(url, "tiny-model", **options)  # type: ignore[arg-type]


def expected_facts() -> list[Fact]:
    return [
        Fact(
            "I moved to Berlin on 2026-11-25",
            ("u1", "u2"),
            "2026-11-25T00:00:00.000000Z",
            "fact",
            "user|home_city",
            "berlin",
        ),
        Fact("I don't drink coffee anymore", ("u1", "u2"), NOW, "preference", "user|likes:coffee", "no"),
    ]


def test_valid_reply_and_request_shape(server: tuple[str, Script]) -> None:
    url, script = server
    script.replies.append((200, completion(json.dumps({"facts": ITEMS})), 0.0))
    assert extractor(url).extract(TURNS) == expected_facts()
    ((headers, body),) = script.requests
    assert headers["Authorization"] == f"Bearer {KEY}"
    assert body["model"] == "tiny-model"
    assert body["response_format"]["type"] == "json_schema"
    schema = body["response_format"]["json_schema"]["schema"]
    assert list(schema["properties"]["facts"]["items"]["properties"]) == [
        "text",
        "kind",
        "subject",
        "attribute",
        "value",
        "date",
    ]
    log = body["messages"][1]["content"]
    assert "[2026-11-26 Thu] user: I moved to Berlin yesterday!" in log
    assert "[2026-11-26 Thu] assistant: Congratulations!" in log


def test_fenced_reply_is_repaired(server: tuple[str, Script]) -> None:
    url, script = server
    fenced = "Sure!\n```json\n" + json.dumps({"facts": ITEMS}) + "\n```"
    script.replies.append((200, completion(fenced), 0.0))
    assert extractor(url).extract(TURNS) == expected_facts()


def test_garbage_reply_is_not_transient(server: tuple[str, Script]) -> None:
    url, script = server
    script.replies.append((200, completion("I am unable to comply."), 0.0))
    with pytest.raises(ExtractionError, match="not a facts array") as err:
        extractor(url).extract(TURNS)
    assert err.value.transient is False and len(script.requests) == 1


def test_500_then_ok_is_retried(server: tuple[str, Script]) -> None:
    url, script = server
    script.replies += [(500, b'{"error": "boom"}', 0.0), (200, completion(json.dumps({"facts": ITEMS})), 0.0)]
    sleeps: list[float] = []
    got = extractor(url, backoff_s=0.25, sleep=sleeps.append).extract(TURNS)
    assert got == expected_facts() and len(script.requests) == 2 and sleeps == [0.25]


def test_5xx_and_429_until_the_retries_run_out_are_transient(server: tuple[str, Script]) -> None:
    url, script = server
    script.replies += [(503, b"{}", 0.0), (429, b"{}", 0.0), (502, b"{}", 0.0)]
    sleeps: list[float] = []
    with pytest.raises(ExtractionError, match="HTTP 502 .* after 3 attempts") as err:
        extractor(url, backoff_s=0.1, sleep=sleeps.append).extract(TURNS)
    assert err.value.transient is True and len(script.requests) == 3 and sleeps == [0.1, 0.2]


def test_timeout_is_transient(server: tuple[str, Script]) -> None:
    url, script = server
    script.replies += [(200, completion('{"facts": []}'), 1.0)]
    with pytest.raises(ExtractionError, match="timed out") as err:
        extractor(url, timeout_s=0.2, max_retries=0).extract(TURNS)
    assert err.value.transient is True


def test_400_is_not_transient_and_not_retried_and_the_key_is_never_logged(
    server: tuple[str, Script], caplog: pytest.LogCaptureFixture
) -> None:
    url, script = server
    script.replies += [(400, json.dumps({"error": f"bad key {KEY}"}).encode(), 0.0)]
    with caplog.at_level(logging.DEBUG), pytest.raises(ExtractionError, match="HTTP 400") as err:
        extractor(url).extract(TURNS)
    assert err.value.transient is False and len(script.requests) == 1
    assert KEY not in str(err.value) and "***" in str(err.value)
    script.replies += [(500, b"{}", 0.0)] * 3
    with caplog.at_level(logging.DEBUG), pytest.raises(ExtractionError):
        extractor(url).extract(TURNS)
    assert caplog.records and all(KEY not in r.getMessage() for r in caplog.records)
    assert KEY not in repr(extractor(url))


def test_connection_refused_is_transient() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again before the request: nothing listens there
    with pytest.raises(ExtractionError) as err:
        extractor(f"http://127.0.0.1:{port}", max_retries=1).extract(TURNS)
    assert err.value.transient is True


def test_no_user_turn_sends_nothing(server: tuple[str, Script]) -> None:
    url, script = server
    assert extractor(url).extract([TurnInput("a", "assistant", "Hello!", NOW)]) == []
    assert script.requests == []


def test_options_are_validated_and_the_registry_builds_it() -> None:
    with pytest.raises(ValueError, match="OpenAIExtractor.timeout_s: must be > 0, got 0"):
        OpenAIExtractor("http://x", "m", timeout_s=0)
    with pytest.raises(ValueError, match="OpenAIExtractor.url: must start with http:// or https://, got 'x'"):
        OpenAIExtractor("x", "m")
    built = make_extractor("openai", url="http://h:8000", model="m")
    assert isinstance(built, OpenAIExtractor) and built.endpoint == "http://h:8000/v1/chat/completions"
    assert OpenAIExtractor("http://h/v1/chat/completions", "m").endpoint == "http://h/v1/chat/completions"


def test_a_server_refusing_response_format_is_asked_without_it_from_then_on(
    server: tuple[str, Script],
) -> None:
    """As kvmem's own endpoint and many other OpenAI-compatible servers answer: 400 naming the field."""
    url, script = server
    refusal = {"error": {"message": "response_format is not supported", "param": "response_format"}}
    ok = completion(json.dumps({"facts": ITEMS}))
    script.replies += [(400, json.dumps(refusal).encode(), 0.0), (200, ok, 0.0), (200, ok, 0.0)]
    x = extractor(url)
    assert x.extract(TURNS) == expected_facts() and x.extract(TURNS) == expected_facts()
    assert ["response_format" in body for _, body in script.requests] == [True, False, False]


def test_bare_string_items_and_a_looping_cut_off_reply_give_each_fact_once(
    server: tuple[str, Script],
) -> None:
    """What a 0.5B model answered through kvmem's own endpoint: strings, repeated until max_tokens."""
    url, script = server
    looping = '{"facts": [' + ", ".join(['"I moved to Berlin yesterday"'] * 6) + ', "I moved to Ber'
    script.replies.append((200, completion(looping), 0.0))
    [fact] = extractor(url).extract(TURNS)
    assert (fact.text, fact.slot, fact.valid_from) == (
        "I moved to Berlin on 2026-11-25",
        None,
        "2026-11-25T00:00:00.000000Z",
    )

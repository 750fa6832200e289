"""A client that goes away mid-stream stops generation (live server, fake backend: plumbing only)."""

from __future__ import annotations

from pathlib import Path

import httpx

from serving.backends.fake import FakeBackend
from tests.serving.conftest import ALICE, MODEL, live_server, make_stack, wait_for

REPLY_CHARS = 20_000


def test_disconnect_stops_generation(tmp_path: Path) -> None:
    stack = make_stack(
        tmp_path,
        backend=FakeBackend(reply="x" * REPLY_CHARS, token_delay_s=0.001, max_context_tokens=2 * REPLY_CHARS),
    )
    body = {
        "model": MODEL,
        "stream": True,
        "max_tokens": REPLY_CHARS,
        "messages": [{"role": "user", "content": "talk forever"}],
    }
    with live_server(stack.app) as url:
        with (
            httpx.Client(timeout=30) as http,
            http.stream("POST", f"{url}/v1/chat/completions", json=body, headers=ALICE) as r,
        ):
            assert r.status_code == 200
            assert next(line for line in r.iter_lines() if '"content": "x"' in line)
        wait_for(lambda: len(stack.backend.outcomes) == 1, "the generation to end")
        (outcome,) = stack.backend.outcomes
        assert outcome.how in ("disconnected", "closed")
        assert outcome.num_tokens < REPLY_CHARS
        assert stack.backend.num_in_flight == 0
        text = httpx.get(f"{url}/metrics").text
        assert "kvmem_queue_depth 0" in text
    # a turn that was not completed is not stored
    assert stack.store.count("alice") == 0
    stack.scheduler.stop()

"""Memory formation through HTTP with the fake backend and the server's own formation worker: chat turns go to
the conversation log, the user's statements become memories in the background, a changed fact supersedes
the old one, delete is forget, and a failing extractor delays formation only."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from kvmem.formation.errors import ExtractionError
from kvmem.formation.rules import RuleExtractor
from kvmem.formation.types import Fact, TurnInput
from scheduler.formation import FormationConfig, FormationWorker
from serving.http.app import create_app
from tests.serving.conftest import ALICE, MODEL, Stack, make_stack, wait_for


def chat(client: TestClient, content: str, **extra) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}
    r = client.post("/v1/chat/completions", json=body, headers=ALICE)
    assert r.status_code == 200, r.text
    return r.json()


def settle(client: TestClient, stack: Stack) -> None:
    """The turn stored (the chat's background task), formed (the worker), and its events applied."""
    client.portal.call(client.app.state.chat.drain)  # the turn is in the log
    worker: FormationWorker = client.app.state.formation
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if stack.store.formation_counts("alice").pending == 0 and worker.idle():
            break
        time.sleep(0.01)
    assert worker.wait_idle(20)
    stack.scheduler.flush()


def memories(client: TestClient, **params) -> list[dict]:
    r = client.get("/v1/memories", params={"user_id": "alice", "page_size": 100, **params}, headers=ALICE)
    assert r.status_code == 200, r.text
    return r.json()["data"]


def turns(client: TestClient) -> list[dict]:
    r = client.get("/v1/memories/turns", params={"user_id": "alice", "page_size": 100}, headers=ALICE)
    assert r.status_code == 200, r.text
    return r.json()["data"]


def test_a_chat_turn_is_logged_and_only_the_users_statement_becomes_a_memory(stack: Stack, client) -> None:
    stack.backend.reply = "Your cat is called Pixel."  # an assistant reply must never become a memory
    chat(client, "Hi! My cat is called Pixel. What should I feed her?")
    settle(client, stack)
    log = turns(client)
    assert [(t["role"], t["text"]) for t in log][::-1] == [
        ("user", "Hi! My cat is called Pixel. What should I feed her?"),
        ("assistant", "Your cat is called Pixel."),
    ]
    assert [t["formation"] for t in log][::-1] == ["formed", "skipped"]
    user_turn = log[-1]["id"]
    formed = memories(client)
    assert [(m["text"], m["source"], m["source_turn_ids"], m["role"]) for m in formed] == [
        ("My cat is called Pixel.", "conversation", [user_turn], "user")
    ]
    # the memory is served like any other: the next turn's prompt carries it
    chat(client, "What is my cat called?")
    assert "My cat is called Pixel." in stack.backend.decode(stack.backend.requests[-1].prompt.ids)


def test_a_moved_user_supersedes_the_old_city_everywhere(stack: Stack, client) -> None:
    r = client.post("/v1/memories", json={"user_id": "alice", "text": "I live in Lisbon."}, headers=ALICE)
    lisbon = r.json()["memories"][0]["id"]
    stack.scheduler.flush()
    assert client.get("/v1/memories/plan", params={"user_id": "alice"}, headers=ALICE).json()["block"][
        "memory_ids"
    ] == [lisbon]
    chat(client, "I moved to Berlin.")
    settle(client, stack)
    served = memories(client)
    assert [m["text"] for m in served] == ["I moved to Berlin."]
    berlin = served[0]["id"]
    everything = {m["id"]: m for m in memories(client, include_superseded="true")}
    assert set(everything) == {lisbon, berlin}
    old = everything[lisbon]
    assert old["superseded_by"] == berlin and old["valid_to"] == everything[berlin]["valid_from"]
    # never injected: not in the block, not searched, not in the next prompt
    plan = client.get("/v1/memories/plan", params={"user_id": "alice"}, headers=ALICE).json()
    assert plan["block"]["memory_ids"] == [berlin]
    body = {"user_id": "alice", "query": "Where do I live? Lisbon"}
    hits = client.post("/v1/memories/search", json=body, headers=ALICE).json()["results"]
    assert lisbon not in [h["id"] for h in hits]
    hits = client.post("/v1/memories/search", json={**body, "include_superseded": True}, headers=ALICE)
    assert lisbon in [h["id"] for h in hits.json()["results"]]
    chat(client, "Where do I live?")
    prompt = stack.backend.decode(stack.backend.requests[-1].prompt.ids)
    assert "I moved to Berlin." in prompt and "Lisbon" not in prompt


def test_delete_is_forget_the_source_turns_go_too(stack: Stack, client) -> None:
    chat(client, "My cat is called Pixel.")
    chat(client, "I am allergic to peanuts.")
    settle(client, stack)
    by_text = {m["text"]: m for m in memories(client)}
    assert set(by_text) == {"My cat is called Pixel.", "I am allergic to peanuts."}
    pixel, peanuts = by_text["My cat is called Pixel."], by_text["I am allergic to peanuts."]
    r = client.delete(f"/v1/memories/{pixel['id']}", params={"user_id": "alice"}, headers=ALICE)
    assert r.json() == {"deleted": 1}
    left = [t["text"] for t in turns(client) if t["role"] == "user"]
    assert left == ["I am allergic to peanuts."]
    r = client.delete(
        f"/v1/memories/{peanuts['id']}", params={"user_id": "alice", "keep_turns": "true"}, headers=ALICE
    )
    assert r.json() == {"deleted": 1}
    assert [t["text"] for t in turns(client) if t["role"] == "user"] == ["I am allergic to peanuts."]
    assert memories(client) == []


def test_health_metrics_and_formation_status(stack: Stack, client) -> None:
    chat(client, "I work as a nurse.")
    settle(client, stack)
    health = client.get("/health").json()
    assert health["formation"] == {
        "extractor": "rules",
        "pending_turns": 0,
        "dead_turns": 0,
        "circuit": "closed",
        "circuit_until": None,
        "last_error": None,
    }
    status = client.get("/v1/memories/formation", params={"user_id": "alice"}, headers=ALICE).json()
    assert status == {
        "user_id": "alice",
        "extractor": "rules",
        "pending": 0,
        "retrying": [],
        "dead_letter": [],
    }
    text = client.get("/metrics").text
    assert "kvmem_formation_pending_turns 0\n" in text
    assert "kvmem_formation_memories_added_total 1\n" in text
    assert "kvmem_formation_formed_turns_total 1\n" in text


def test_no_store_turns_logs_nothing(tmp_path: Path) -> None:
    stack = make_stack(tmp_path, store_turns=False)
    with TestClient(stack.app) as client:
        assert client.app.state.formation is None
        chat(client, "My cat is called Pixel.")
        client.app.state.chat  # noqa: B018
        assert turns(client) == [] and memories(client) == []
    stack.scheduler.stop()


class _Flaky:
    """An extractor that fails `failures` times with the given kind of error, then extracts by the rules."""

    name = "flaky"

    def __init__(self, failures: int, transient: bool) -> None:
        self.failures, self.transient, self.calls = failures, transient, 0
        self._rules = RuleExtractor()

    def extract(self, turns: Sequence[TurnInput]) -> list[Fact]:
        self.calls += 1
        if self.calls <= self.failures:  # as an extractor's error may: it quotes what it was given
            quoted = turns[0].text[:40]
            raise ExtractionError(
                f"endpoint answered 503 to {quoted!r}", transient=self.transient, kind="http_503"
            )
        return self._rules.extract(turns)


def _stack_with(tmp_path: Path, extractor, **formation_kw) -> tuple[Stack, FormationWorker]:
    stack = make_stack(tmp_path)
    worker = FormationWorker(
        stack.store, extractor, FormationConfig(retry_backoff_s=0.01, rescan_interval_s=60, **formation_kw)
    )
    worker.start()
    stack.app = create_app(
        stack.config, backend=stack.backend, store=stack.store, scheduler=stack.scheduler, formation=worker
    )
    return stack, worker


def test_a_failing_extractor_delays_formation_only_and_health_never_quotes_a_user(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 42 items 11 and 14: the extractor fails (transiently) with an error quoting the user's turn. The turn
    stays pending, never dead-lettered; the unauthenticated /health names the failure's kind and time only,
    and no log line quotes the turn; the user's own formation route has the reason. When the extractor is
    back, formation resumes by itself: nobody requeues anything."""
    caplog.set_level(logging.DEBUG)
    stack, worker = _stack_with(tmp_path, _Flaky(failures=10**9, transient=True), circuit_failures=1)
    secret = "My PIN is 4711 and I have diabetes."
    try:
        with TestClient(stack.app) as client:
            chat(client, secret)
            wait_for(lambda: worker.extractor.calls >= 3, "the extractor to fail a few times")
            status = client.get("/v1/memories/formation", params={"user_id": "alice"}, headers=ALICE).json()
            assert status["pending"] == 1 and status["dead_letter"] == []
            [retrying] = status["retrying"]
            assert retrying["reason"] == f"flaky: endpoint answered 503 to {secret[:40]!r}"
            health = client.get("/health")
            assert "4711" not in health.text and "diabetes" not in health.text
            formation = health.json()["formation"]
            assert formation["last_error"]["kind"] == "http_503"
            assert formation["last_error"]["at"].endswith("Z") and formation["dead_turns"] == 0
            assert formation["circuit"] == "open" and formation["pending_turns"] == 1
            assert "kvmem_formation_circuit_open 1\n" in client.get("/metrics").text
            assert memories(client) == []  # the turn stays in the log
            worker.extractor.failures = 0  # the endpoint is back
            wait_for(lambda: memories(client) != [], "formation to resume by itself")
            assert sorted(m["text"] for m in memories(client)) == ["I have diabetes.", "My PIN is 4711."]
            assert worker.stats.dead_lettered_total == 0
    finally:
        worker.stop()
        stack.scheduler.stop()
    assert not [r for r in caplog.records if "4711" in r.getMessage() or "diabetes" in r.getMessage()]


def test_a_permanent_error_dead_letters_at_once(tmp_path: Path) -> None:
    stack, worker = _stack_with(tmp_path, _Flaky(failures=1, transient=False))
    try:
        with TestClient(stack.app) as client:
            chat(client, "My cat is called Pixel.")
            deadline = time.monotonic() + 20
            while stack.store.formation_counts("alice").dead == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            [dead] = client.get("/v1/memories/formation", params={"user_id": "alice"}, headers=ALICE).json()[
                "dead_letter"
            ]
            assert dead["attempts"] == 1 and worker.extractor.calls == 1
    finally:
        worker.stop()
        stack.scheduler.stop()


class _Gated:
    """Extracts by the rules once `release` is set; `entered` says a pass is inside extract."""

    name = "gated"

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()

    def extract(self, turns: Sequence[TurnInput]) -> list[Fact]:
        self.entered.set()
        assert self.release.wait(20)
        return RuleExtractor().extract(turns)


@pytest.mark.parametrize("route", ["user", "memory_ids"])
def test_a_user_deleted_while_their_turns_are_formed_leaves_nothing_behind(
    tmp_path: Path, route: str
) -> None:
    extractor = _Gated()
    stack, worker = _stack_with(tmp_path, extractor)
    try:
        with TestClient(stack.app) as client:
            chat(client, "My cat is called Pixel.")
            assert extractor.entered.wait(20)
            r = client.delete("/v1/memories", params={"user_id": "alice"}, headers=ALICE)
            assert r.status_code == 200
            extractor.release.set()
            assert worker.wait_idle(20)
            assert memories(client, include_superseded="true") == [] and turns(client) == []
            assert stack.store.formation_counts("alice").pending == 0
    finally:
        worker.stop()
        stack.scheduler.stop()


def test_the_openai_extractor_works_over_kvmems_own_endpoint(tmp_path: Path) -> None:
    """kvmem's own chat endpoint as the extractor's server (the fake backend stands in for the model: this
    checks the protocol both ways, not a model's extraction)."""
    from kvmem.formation.llm import OpenAIExtractor
    from serving.backends.fake import FakeBackend
    from tests.serving.conftest import live_server

    reply = (
        '{"facts": [{"text": "I moved to Berlin yesterday", "kind": "fact", "subject": "user", '
        '"attribute": "home_city", "value": "Berlin", "date": null}]}'
    )
    endpoint = make_stack(tmp_path, auth=False, backend=FakeBackend(reply=reply), extractor="none")
    turn = TurnInput("t1", "user", "I moved to Berlin yesterday!", "2026-11-26T10:00:00.000000Z")
    try:
        with live_server(endpoint.app) as url:
            [fact] = OpenAIExtractor(f"{url}/v1", "default", timeout_s=30).extract([turn])
    finally:
        endpoint.scheduler.stop()
    assert (fact.text, fact.slot, fact.value, fact.turn_ids) == (
        "I moved to Berlin on 2026-11-25",
        "user|home_city",
        "berlin",
        ("t1",),
    )
    asked = endpoint.backend.decode(endpoint.backend.requests[-1].prompt.ids)
    assert "[2026-11-26 Thu] user: I moved to Berlin yesterday!" in asked

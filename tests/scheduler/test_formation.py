"""The formation worker over a real store: one pass forms, merges and supersedes exactly; the queue is bounded
and coalesced, overflowed users come back with the rescan; transient failures back off and open a circuit that
closes by itself, a permanent one bisects the batch before dead-lettering a turn."""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from dataclasses import replace
from datetime import date, datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvmem.formation.errors import ExtractionError
from kvmem.formation.llm import OpenAIExtractor
from kvmem.formation.rules import RuleExtractor
from kvmem.formation.types import Fact, TurnInput
from kvmem.text import MemoryStore
from kvmem.text.records import FormationCounts
from scheduler.formation import FormationConfig, FormationWorker


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def say(store: MemoryStore, user: str, *texts: str) -> list[str]:
    turns = store.log_turns(user, [{"role": "user", "content": t} for t in texts])
    return [t.id for t in turns]


def served(store: MemoryStore, user: str = "u") -> list[str]:
    return sorted(m.text for m in store.list(user, page_size=100).items)


def test_one_pass_forms_merges_and_supersedes(store: MemoryStore) -> None:
    worker = FormationWorker(store, RuleExtractor())
    [lisbon_turn] = say(store, "u", "I live in Lisbon.")
    assert worker.form_user("u").num_added == 1
    [lisbon] = store.list("u").items
    assert (lisbon.source, lisbon.source_turn_ids, lisbon.slot) == (
        "conversation",
        (lisbon_turn,),
        "user|home_city",
    )
    # the same fact again: merged into the memory (its provenance grows), nothing added
    [again] = say(store, "u", "I live in Lisbon.")
    result = worker.form_user("u")
    assert (result.num_added, result.num_duplicates) == (0, 1)
    assert store.get("u", lisbon.id).source_turn_ids == (lisbon_turn, again)
    # a move supersedes it; a trip does not
    say(store, "u", "I moved to Berlin.", "I went to Paris for a weekend.")
    result = worker.form_user("u")
    assert (result.num_turns, result.num_superseded) == (2, 1)
    assert served(store) == ["I moved to Berlin.", "I went to Paris for a weekend."]
    old = store.get("u", lisbon.id)
    berlin = next(m for m in store.list("u").items if m.text == "I moved to Berlin.")
    assert old.superseded_by == berlin.id and old.valid_to == berlin.valid_from
    assert worker.form_user("u").num_turns == 0  # nothing pending


def test_a_later_fact_of_the_same_batch_supersedes_an_earlier_one(store: MemoryStore) -> None:
    worker = FormationWorker(store, RuleExtractor())
    say(store, "u", "My dog is called Max.", "Actually, my dog is called Rex.")
    worker.form_user("u")
    assert served(store) == ["My dog is called Rex."]
    everything = store.list("u", include_superseded=True, page_size=100).items
    max_ = next(m for m in everything if "Max" in m.text)
    assert max_.superseded_by == next(m for m in everything if "Rex" in m.text).id


def test_isolation_one_users_facts_never_touch_anothers(store: MemoryStore) -> None:
    worker = FormationWorker(store, RuleExtractor())
    say(store, "a", "I live in Lisbon.")
    say(store, "b", "I moved to Berlin.")
    worker.form_user("a")
    worker.form_user("b")
    assert served(store, "a") == ["I live in Lisbon."] and served(store, "b") == ["I moved to Berlin."]


def test_the_queue_is_coalesced_and_bounded_and_the_rescan_brings_overflow_back(store: MemoryStore) -> None:
    clock = FakeClock()
    worker = FormationWorker(store, RuleExtractor(), FormationConfig(max_queued_users=2), clock=clock)
    for user in ("a", "a", "b", "c"):
        say(store, user, "I live in Lisbon.")
    assert [worker.submit(u) for u in ("a", "a", "b", "c")] == [True, True, True, False]
    assert worker.stats.queued_users == 2 and worker.stats.overflowed_total == 1
    assert list(worker._queue) == ["a", "b"]
    worker.forget("a")
    worker.forget("b")
    assert worker.rescan() == 2  # c's turns waited in the log; the queue holds 2 again
    assert set(worker._queue) == {"a", "b"} and worker.stats.overflowed_total == 2


class Failing:
    name = "failing"

    def __init__(self, transient: bool, failures: int = 99) -> None:
        self.transient, self.failures, self.calls = transient, failures, 0

    def extract(self, turns: Sequence[TurnInput]) -> list[Fact]:
        self.calls += 1
        if self.calls <= self.failures:
            raise ExtractionError("timed out after 30 s", transient=self.transient)
        return RuleExtractor().extract(turns)


def test_transient_failures_back_off_to_minutes_and_never_dead_letter(store: MemoryStore) -> None:
    """Issue 42 item 11: an extractor that stays down used to dead-letter the turn at its third attempt
    (about 6 s). The turn stays pending however long it lasts; the user's wait doubles up to max_backoff_s."""
    clock = FakeClock()
    config = FormationConfig(retry_backoff_s=2.0, max_backoff_s=300.0, circuit_failures=100)
    worker = FormationWorker(store, Failing(transient=True), config, clock=clock)
    [turn] = say(store, "u", "I live in Lisbon.")
    waits = []
    for _ in range(12):
        result = worker.form_user("u")
        assert (result.error, result.dead, result.transient) == ("failing: timed out after 30 s", False, True)
        waits.append(worker._queue["u"] - clock.now)
        worker.forget("u")
    assert waits == [2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 300.0, 300.0, 300.0, 300.0]
    [pending] = store.pending_turns("u")
    assert (pending.id, pending.attempts, pending.error) == (turn, 12, "failing: timed out after 30 s")
    assert store.formation_counts("u").dead == 0 and worker.stats.dead_lettered_total == 0
    assert worker.stats.failures_total == 12 and worker.stats.last_error_kind == "extractor_error"
    worker.extractor.failures = 0
    assert worker.form_user("u").num_added == 1 and served(store) == ["I live in Lisbon."]


def test_the_rescan_leaves_a_user_who_backs_off_waiting(store: MemoryStore) -> None:
    """The rescan (every 30 s) made a user backing off after failures due again at once."""
    clock = FakeClock()
    worker = FormationWorker(
        store, Failing(transient=True), FormationConfig(retry_backoff_s=8.0), clock=clock
    )
    say(store, "u", "I live in Lisbon.")
    say(store, "v", "I live in Porto.")
    worker.form_user("u")
    assert worker._queue == {"u": 108.0}
    assert worker.rescan() == 2
    assert worker._queue == {"u": 108.0, "v": 100.0}  # v (not queued) is due now, u still waits


def test_a_permanent_failure_dead_letters_a_single_turn_at_once(store: MemoryStore) -> None:
    worker = FormationWorker(store, Failing(transient=False))
    say(store, "u", "I live in Lisbon.")
    result = worker.form_user("u")
    assert (result.num_dead, result.transient) == (1, False) and store.formation_counts("u").dead == 1


class Poisoned:
    """Extracts by the rules, except that a batch holding a turn that says POISON gets a malformed reply."""

    name = "poisoned"

    def __init__(self) -> None:
        self.batches: list[int] = []

    def extract(self, turns: Sequence[TurnInput]) -> list[Fact]:
        self.batches.append(len(turns))
        if any("POISON" in t.text for t in turns):
            raise ExtractionError(
                "reply content is not a facts array", transient=False, kind="malformed_reply"
            )
        return RuleExtractor().extract(turns)


def test_a_malformed_reply_bisects_the_batch_and_dead_letters_only_the_turn_that_fails_alone(
    store: MemoryStore,
) -> None:
    """One malformed reply used to dead-letter the whole batch. The batch is split in halves down to the turn
    whose reply is malformed on its own; every other turn is formed."""
    worker = FormationWorker(store, Poisoned(), FormationConfig(batch_turns=8))
    texts = [
        "I live in Lisbon.",
        "My cat is called Pixel.",
        "I am allergic to peanuts.",
        "POISON",
        "I work as a nurse.",
        "My dog is called Rex.",
    ]
    ids = say(store, "u", *texts)
    result = worker.form_user("u")
    assert (result.num_turns, result.num_added, result.num_dead) == (6, 5, 1)
    assert worker.extractor.batches == [6, 3, 3, 1, 2]  # [6] -> [3] formed + [3] -> [1] dead + [2] formed
    [dead] = store.dead_turns("u")
    assert (dead.id, dead.attempts, dead.error) == (ids[3], 1, "poisoned: reply content is not a facts array")
    assert store.formation_counts("u").pending == 0
    assert served(store) == [
        "I am allergic to peanuts.",
        "I live in Lisbon.",
        "I work as a nurse.",
        "My cat is called Pixel.",
        "My dog is called Rex.",
    ]
    assert worker.stats.dead_lettered_total == 1 and worker.stats.last_error_kind == "malformed_reply"


class Undatable:
    """Extracts by the rules, but a fact of a turn that says "ages ago" carries a time the store refuses."""

    name = "undatable"

    def extract(self, turns: Sequence[TurnInput]) -> list[Fact]:
        facts = RuleExtractor().extract(turns)
        bad = {t.id for t in turns if "ages ago" in t.text}
        return [replace(f, valid_from="long ago") if bad & set(f.turn_ids) else f for f in facts]


def test_a_fact_the_store_refuses_dead_letters_its_turn_and_the_others_are_formed(store: MemoryStore) -> None:
    """A refused fact (InvalidMemoryInput from commit_formed) was taken for a passing store failure: the turns
    stayed pending with no attempt counted and the user was retried forever, every later turn stuck behind."""
    clock = FakeClock()
    worker = FormationWorker(store, Undatable(), FormationConfig(batch_turns=4), clock=clock)
    ids = say(store, "u", "I live in Lisbon.", "I moved to Porto ages ago.", "My dog is called Rex.")
    worker.submit("u")
    result = worker.run_once()
    assert (result.num_turns, result.num_added, result.num_dead, result.transient) == (3, 2, 1, False)
    [dead] = store.dead_turns("u")
    assert (dead.id, dead.error) == (
        ids[1],
        "undatable: the store refused a formed fact: adds[0].valid_from is not an ISO 8601 time: 'long ago'",
    )
    assert store.formation_counts("u").pending == 0 and served(store) == [
        "I live in Lisbon.",
        "My dog is called Rex.",
    ]
    assert worker.stats.last_error_kind == "store_refused" and worker.run_once() is None  # nothing queued


def test_a_fact_dated_before_the_year_1000_is_stored_with_a_four_digit_year(store: MemoryStore) -> None:
    """iso_time wrote year 1 as "1-01-01T..." (strftime's %Y is not zero-padded), which the store refused."""
    from kvmem.formation.dates import iso_time

    assert iso_time(date(1, 1, 1)) == "0001-01-01T00:00:00.000000Z"
    [m] = store.add("u", texts=["I was born in Lisbon."], chat_time=iso_time(date(999, 6, 1)))
    assert m.chat_time == "0999-06-01T00:00:00.000000Z"


class FakeEndpoint:
    """An OpenAI-compatible chat endpoint on loopback: 503 while `down`, else one fact per user line."""

    def __init__(self) -> None:
        self.down, self.requests = True, 0
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                endpoint.requests += 1
                if endpoint.down:
                    self.send_response(503)
                    self.end_headers()
                    return
                lines = body["messages"][-1]["content"].splitlines()[1:]
                facts = [{"text": line.split("] user: ", 1)[1], "kind": "fact"} for line in lines]
                content = json.dumps({"facts": facts})
                reply = json.dumps({"choices": [{"message": {"role": "assistant", "content": content}}]})
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(reply.encode())

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def endpoint():
    e = FakeEndpoint()
    yield e
    e.close()


def test_an_extractor_outage_opens_the_circuit_and_formation_resumes_by_itself(
    store: MemoryStore, endpoint: FakeEndpoint
) -> None:
    """The endpoint answers 503 (the extractor's own retries off): after 3 failures in a row the circuit opens
    and no pass runs, not even for a user who just said something; at each reopening one probe runs, and the
    probe's wait doubles. Once the endpoint is back, the next probe forms and every user resumes at once,
    their own backoffs notwithstanding; nothing was dead-lettered, nobody requeued anything."""
    clock = FakeClock()
    wall = datetime(2026, 11, 26, 12, 0, tzinfo=timezone.utc)
    config = FormationConfig(retry_backoff_s=2.0, max_backoff_s=60.0, circuit_failures=3)
    extractor = OpenAIExtractor(endpoint.url, "m", max_retries=0, sleep=lambda s: None)
    worker = FormationWorker(store, extractor, config, clock=clock, wall_clock=lambda: wall)
    for user in ("a", "b", "c"):
        say(store, user, f"I am user {user}.")
        worker.submit(user)
    for _ in range(3):  # three failures in a row, one per user
        result = worker.run_once()
        assert result is not None and result.transient
    assert endpoint.requests == 3 and worker.stats.circuit == "open" and worker.stats.circuit_open == 1
    assert worker.stats.circuit_until == "2026-11-26T12:00:02.000000Z"
    assert (worker.stats.last_error_kind, worker.stats.last_error_at) == (
        "http_503",
        "2026-11-26T12:00:00.000000Z",
    )
    say(store, "d", "I am user d.")
    worker.submit("d")
    assert worker.run_once() is None and worker.idle()  # open: nothing runs, nothing is due
    clock.now += 2.0
    assert worker.run_once().transient and endpoint.requests == 4  # the probe fails: open for 4 s
    clock.now += 3.9
    assert worker.run_once() is None
    clock.now += 0.1
    assert worker.run_once().transient and endpoint.requests == 5  # open for 8 s now
    endpoint.down = False
    clock.now += 7.0
    assert worker.run_once() is None  # still open: nobody asks the endpoint
    clock.now += 1.0
    assert worker.run_once().num_added == 1  # the probe: the extractor is back, the circuit closes
    assert worker.stats.circuit == "closed" and worker.stats.circuit_until is None
    while worker.run_once() is not None:  # every other user is due at once
        pass
    assert [served(store, u) for u in "abcd"] == [
        ["I am user a."],
        ["I am user b."],
        ["I am user c."],
        ["I am user d."],
    ]
    assert store.formation_counts() == FormationCounts(pending=0, dead=0)
    assert worker.stats.dead_lettered_total == 0


def test_requeue_all_dead_puts_every_users_dead_turns_back(store: MemoryStore) -> None:
    worker = FormationWorker(store, Failing(transient=False, failures=2))
    say(store, "a", "I live in Lisbon.")
    say(store, "b", "I live in Porto.")
    worker.form_user("a")
    worker.form_user("b")
    assert store.formation_counts() == FormationCounts(pending=0, dead=2)
    assert worker.requeue_all_dead() == 2
    assert set(worker._queue) == {"a", "b"}
    while worker.run_once() is not None:
        pass
    assert served(store, "a") == ["I live in Lisbon."] and served(store, "b") == ["I live in Porto."]
    assert worker.requeue_all_dead() == 0


def test_the_thread_forms_what_is_submitted(store: MemoryStore) -> None:
    worker = FormationWorker(store, RuleExtractor(), FormationConfig(batch_turns=2))
    worker.start()
    try:
        say(store, "u", "I live in Lisbon.", "I am allergic to peanuts.", "My cat is called Pixel.")
        worker.submit("u")
        assert worker.wait_idle(20)
        assert served(store) == ["I am allergic to peanuts.", "I live in Lisbon.", "My cat is called Pixel."]
    finally:
        worker.stop()


def test_pending_turns_are_resumed_at_start(store: MemoryStore) -> None:
    say(store, "u", "I live in Lisbon.")  # logged before a restart; nobody submitted it
    worker = FormationWorker(store, RuleExtractor())
    worker.start()
    try:
        assert worker.wait_idle(20)
        deadline_ok = served(store) == ["I live in Lisbon."]
        assert deadline_ok
    finally:
        worker.stop()


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="circuit_failures must be >= 1, got 0"):
        FormationConfig(circuit_failures=0)
    with pytest.raises(ValueError, match="retry_backoff_s must be > 0"):
        FormationConfig(retry_backoff_s=0)
    with pytest.raises(ValueError, match=r"max_backoff_s must be >= retry_backoff_s \(2.0\), got 1.0"):
        FormationConfig(max_backoff_s=1.0)


def test_newer_is_when_it_was_said_not_the_date_it_names(store: MemoryStore) -> None:
    """A move said today that happened last month retires the city said (added) today before it."""
    [lisbon] = store.add("u", texts=["I live in Lisbon."], slots=[("user|home_city", "lisbon")])
    worker = FormationWorker(store, RuleExtractor())
    say(store, "u", "I moved to Berlin last month.")
    assert worker.form_user("u").num_superseded == 1
    [berlin] = store.list("u").items
    assert berlin.text == "I moved to Berlin in October 2026."
    assert (
        berlin.valid_from == "2026-10-01T00:00:00.000000Z"
        and berlin.chat_time == "2026-11-26T12:00:00.000000Z"
    )
    assert store.get("u", lisbon.id).superseded_by == berlin.id


def test_a_backlog_fact_said_before_a_newer_memory_of_its_slot_is_added_superseded(
    store: MemoryStore,
) -> None:
    """Issue 42 item 12: "I live in Lisbon" said on Nov 20 is formed after "I moved to Berlin" said on Nov 25
    (a backlog): it used to be added as current, two current home cities. It is history: added superseded by
    Berlin, never served."""
    worker = FormationWorker(store, RuleExtractor())
    store.log_turns(
        "u", [{"role": "user", "content": "I moved to Berlin.", "chat_time": "2026-11-25T10:00:00Z"}]
    )
    worker.form_user("u")
    [berlin] = store.list("u").items
    store.log_turns(
        "u", [{"role": "user", "content": "I live in Lisbon.", "chat_time": "2026-11-20T10:00:00Z"}]
    )
    result = worker.form_user("u")
    assert (result.num_added, result.num_superseded) == (1, 1)
    assert served(store) == ["I moved to Berlin."]
    lisbon = next(m for m in store.list("u", include_superseded=True).items if m.id != berlin.id)
    assert (lisbon.text, lisbon.superseded_by, lisbon.valid_to) == (
        "I live in Lisbon.",
        berlin.id,
        berlin.valid_from,
    )
    assert store.get("u", berlin.id).superseded_by is None


def _delete_before_commit(store: MemoryStore, delete) -> None:
    """Make the next commit_formed run `delete()` first: a delete landing while a pass is formed."""
    commit = store.commit_formed

    def hooked(*args, **kwargs):
        store.commit_formed = commit
        delete()
        return commit(*args, **kwargs)

    store.commit_formed = hooked


def test_a_fact_said_twice_and_deleted_while_the_second_waits_does_not_come_back(store: MemoryStore) -> None:
    """Item 20: "I am allergic to peanuts" said twice; the first is formed, the memory deleted while the
    second turn waits for formation (or while it is being formed): the second turn is retired with the
    memory, and nothing comes back."""
    worker = FormationWorker(store, RuleExtractor())
    say(store, "u", "I am allergic to peanuts.")
    worker.form_user("u")
    [allergy] = store.list("u").items
    say(store, "u", "Hi! I am allergic to peanuts. And I live in Lisbon.")
    assert store.delete("u", allergy.id) == 1
    assert store.list_turns("u").total == 0  # the pending restatement went with it
    assert worker.form_user("u").num_turns == 0 and served(store) == []
    # deleted while the pass forms it: the pass judged it a restatement, and retires it
    say(store, "u", "I am allergic to cats.")
    worker.form_user("u")
    [cats] = store.list("u").items
    say(store, "u", "Oh and I am allergic to cats!")
    _delete_before_commit(store, lambda: store.delete("u", cats.id))
    worker.form_user("u")
    assert served(store) == [] and store.list_turns("u").total == 0
    assert store.formation_counts("u").pending == 0


def test_a_restatement_of_a_memory_deleted_otherwise_before_the_commit_is_not_lost(
    store: MemoryStore,
) -> None:
    """Item 13: the second turn is judged a duplicate of the memory, which is deleted before the commit by a
    delete that forgets no fact (keep_turns: the memory goes, the conversation stays): the restatement used to
    be marked formed and lost. It stays pending and the next pass forms it on its own (the delete moved the
    user's generation, so the pass that decided before it writes nothing: StaleFormation)."""
    worker = FormationWorker(store, RuleExtractor())
    say(store, "u", "My cat is called Pixel.")
    worker.form_user("u")
    [pixel] = store.list("u").items
    [again] = say(store, "u", "My cat is called Pixel.")
    _delete_before_commit(store, lambda: store.delete("u", pixel.id, delete_turns=False))
    result = worker.form_user("u")
    assert (result.num_added, result.num_duplicates, worker.stats.stale_total) == (0, 0, 1)
    assert [t.id for t in store.pending_turns("u")] == [again]
    assert "u" in worker._queue  # queued again
    assert worker.form_user("u").num_added == 1
    [formed] = store.list("u").items
    assert (formed.text, formed.source_turn_ids) == ("My cat is called Pixel.", (again,))
    assert formed.id != pixel.id and store.formation_counts("u").pending == 0

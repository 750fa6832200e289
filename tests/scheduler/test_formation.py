"""The formation worker over a real store: one pass forms, merges and supersedes exactly; the queue is bounded
and coalesced, overflowed users come back with the rescan; failures retry with backoff, then dead-letter."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timezone

import pytest

from kvmem.formation.errors import ExtractionError
from kvmem.formation.rules import RuleExtractor
from kvmem.formation.types import Fact, TurnInput
from kvmem.text import HashEmbedder, MemoryStore
from scheduler.formation import FormationConfig, FormationWorker


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def store(tmp_path):
    moment = datetime(2026, 11, 26, 12, 0, tzinfo=timezone.utc)
    s = MemoryStore(tmp_path / "m.sqlite", embedder=HashEmbedder(), clock=lambda: moment)
    yield s
    s.close()


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


def test_transient_failures_back_off_then_dead_letter(store: MemoryStore) -> None:
    clock = FakeClock()
    config = FormationConfig(max_attempts=3, retry_backoff_s=2.0)
    worker = FormationWorker(store, Failing(transient=True), config, clock=clock)
    [turn] = say(store, "u", "I live in Lisbon.")
    first = worker.form_user("u")
    assert (first.error, first.dead) == ("failing: timed out after 30 s", False)
    assert worker._queue["u"] == 102.0  # retried after 2 s
    worker.forget("u")
    assert not worker.form_user("u").dead
    assert worker._queue["u"] == 104.0  # then after 4 s
    third = worker.form_user("u")
    assert third.dead
    [dead] = store.dead_turns("u")
    assert (dead.id, dead.attempts, dead.error) == (turn, 3, "failing: timed out after 30 s")
    assert store.formation_counts("u").pending == 0 and store.formation_counts("u").dead == 1
    assert worker.stats.dead_lettered_total == 1 and worker.stats.failures_total == 3
    assert served(store) == []  # nothing formed, nothing lost: the turn is in the log
    assert store.requeue_dead_turns("u") == 1
    worker.extractor.failures = 0
    assert worker.form_user("u").num_added == 1 and served(store) == ["I live in Lisbon."]


def test_a_permanent_failure_dead_letters_at_once(store: MemoryStore) -> None:
    worker = FormationWorker(store, Failing(transient=False), FormationConfig(max_attempts=3))
    say(store, "u", "I live in Lisbon.")
    assert worker.form_user("u").dead and store.formation_counts("u").dead == 1


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
    with pytest.raises(ValueError, match="max_attempts must be >= 1, got 0"):
        FormationConfig(max_attempts=0)
    with pytest.raises(ValueError, match="retry_backoff_s must be > 0"):
        FormationConfig(retry_backoff_s=0)


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

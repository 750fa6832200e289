"""The formation worker under pressure (wave 4 review): a decision that fails the same way every time is
bisected and dead-lettered, not retried forever; a half-open circuit whose probe fails otherwise opens again
instead of spinning; a stop that times out and a start never run two workers; a batch the engine's pool can
never hold is dead-lettered, not retried forever (serving/background/self_generate.py maps the refusal)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from datetime import datetime, timedelta, timezone
from functools import partial

from kvmem.formation.base import make_extractor
from kvmem.formation.errors import ExtractionError
from kvmem.formation.rules import RuleExtractor, slot_of
from kvmem.formation.self_model import ModelExtractor
from kvmem.text import MemoryStore
from kvmem.utc import utc_text
from scheduler.formation import FormationConfig, FormationWorker
from scheduler.formation_decisions import decide
from serving.background.self_generate import backend_generate
from serving.engine.errors import PoolTooSmall
from tests.scheduler.test_formation import FakeClock
from tests.serving.kvstack import load_backend


def run_passes(store, extractor, passes: int) -> FormationWorker:
    """The user's turns formed by a worker with the extractor's own decider, `passes` passes 1000 s apart (every
    backoff over): a failure that repeats shows as the same turns pending after all of them."""
    clock = FakeClock()
    worker = FormationWorker(
        store, extractor, FormationConfig(circuit_failures=100), clock=clock, decider=extractor.decide
    )
    worker.submit("u")
    for _ in range(passes):
        clock.now += 1000
        worker.run_once()
    return worker


def fact(text):
    return {"text": text, "kind": "fact", "subject": None, "attribute": None, "value": None, "date": None}


def test_a_cut_decision_is_dead_lettered_not_retried_forever(store):
    store.add("u", texts=["I live in Lisbon."])
    store.log_turns("u", [{"role": "user", "content": "I moved to Berlin."}])
    store.log_turns("u", [{"role": "user", "content": "I have a cat called Tom."}])

    def generate(messages, schema, max_tokens):
        if "facts" in schema.get("properties", {}):
            lines = [x.split("user: ", 1)[1] for x in messages[-1]["content"].splitlines() if "user: " in x]
            return json.dumps({"facts": [fact(t) for t in lines]}), "stop"
        if "Berlin" in messages[-1]["content"]:
            return '{"event": "upd', "length"  # this decision: cut by max_tokens, every time (greedy)
        return json.dumps({"event": "add", "memory": None}), "stop"

    worker = run_passes(store, ModelExtractor(generate), 20)
    counts = store.formation_counts("u")
    # a permanent failure: the turn should be dead-lettered (or formed), not pending forever
    texts = [m.text for m in store.list("u").items]
    # a permanent failure: bisected, the turn that fails alone dead-lettered, the other formed
    assert (counts.pending, counts.dead) == (0, 1), (counts, worker.stats.last_error_kind, texts)
    assert "I have a cat called Tom." in texts


class Extractor:
    name = "self"

    def __init__(self):
        self.calls = 0

    def extract(self, turns):
        self.calls += 1
        if self.calls == 1:
            raise ExtractionError("engine busy", transient=True, kind="timeout")
        raise PoolTooSmall(5000, 313, 128, 16)  # the batch never fits the pool


def test_a_probe_that_fails_otherwise_does_not_spin(store):
    clock = FakeClock()
    extractor = Extractor()
    worker = FormationWorker(
        store, extractor, FormationConfig(circuit_failures=1, retry_backoff_s=2.0), clock=clock
    )
    store.log_turns("u", [{"role": "user", "content": "I live in Lisbon."}])
    worker.submit("u")
    worker.run_once()  # transient: the circuit opens for 2 s
    assert worker.stats.circuit == "open"
    clock.now += 3.0  # half-open: one probe
    worker.run_once()  # the probe raises PoolTooSmall: u put back at now + 2 s
    for _ in range(100):  # no time passes: u is not due again for 2 s
        worker.run_once()
    assert extractor.calls == 2, (extractor.calls, worker.stats.circuit, worker.stats.last_error_kind)


def test_a_stop_that_times_out_then_a_start_runs_one_worker_not_two(store):
    entered, release = threading.Event(), threading.Event()
    calls = []

    def slow_decide(*args):
        calls.append(threading.current_thread().ident)
        out = decide(*args)
        if len(calls) == 1:  # the first pass: decided, then slow (a model decision at low priority)
            entered.set()
            release.wait(20)
        return out

    worker = FormationWorker(store, RuleExtractor(), decider=slow_decide)
    store.log_turns("u", [{"role": "user", "content": "I live in Lisbon."}])
    worker.start()
    assert entered.wait(10)
    first = worker._thread
    worker.stop(timeout_s=0.2)  # the lifespan's shutdown: the pass is still running
    worker.start()  # the lifespan again (TestClient reused, a reload): the turn is still pending -> rescan queues u
    time.sleep(1.0)
    release.set()
    time.sleep(1.0)
    try:
        texts = [m.text for m in store.list("u").items]
        threads = [t for t in threading.enumerate() if t.name == "kvmem-formation"]
        assert len(threads) == 1 and texts == ["I live in Lisbon."], (len(threads), texts, first.is_alive())
    finally:
        worker.stop()
        with worker._cond:
            worker._stop = True
            worker._cond.notify_all()
        first.join(5)


def test_a_turn_too_long_for_the_pool_is_dead_lettered_not_retried_forever(tiny_model_dir, tmp_path, store):
    backend = load_backend(tiny_model_dir, tmp_path / "data", kv_pool_mb=1, kv_wait_s=0.5)  # 2048 tokens
    try:
        long = "I live in Lisbon and I like " + " ".join(f"apples{i}" for i in range(1500)) + "."
        [t_long] = store.log_turns("u", [{"role": "user", "content": long}])
        [t_short] = store.log_turns("u", [{"role": "user", "content": "I have a cat called Tom."}])
        extractor = ModelExtractor(backend_generate(backend), max_tokens=16, decide_max_tokens=4)
        worker = run_passes(store, extractor, 6)
        counts = store.formation_counts("u")
        pending = [t.id for t in store.pending_turns("u", 10)]
        assert t_long.id not in pending and t_short.id not in pending, (
            counts,
            worker.stats.last_error_kind,
            worker.stats.failures_total,
        )
    finally:
        asyncio.run(backend.aclose())


def test_a_formation_generate_ends_when_the_backend_closes(tiny_model_dir, tmp_path):
    """The server's shutdown closes the model loop while a formation row decodes: the row's stream is told
    (serving/backends/transformers/steps.py), so the formation thread gets a transient error instead of
    waiting on its inbox forever."""
    backend = load_backend(tiny_model_dir, tmp_path / "data")
    generate = backend_generate(backend)
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    outcome: list = []

    def run() -> None:
        try:
            outcome.append(generate([{"role": "user", "content": "Say something long."}], schema, 4000))
        except BaseException as e:  # noqa: BLE001
            outcome.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    time.sleep(1.0)
    assert not outcome, outcome  # still decoding when the server shuts down
    asyncio.run(backend.aclose())
    thread.join(10)
    assert not thread.is_alive(), "generate() still waiting 10 s after the backend closed"
    [error] = outcome
    assert isinstance(error, ExtractionError) and error.transient and error.kind == "engine_busy", error


# ---- an edit while a pass decides -------------------------------------------------------------------------


def served(store):
    return sorted(m.text for m in store.list("u", page_size=100).items)


def edited_meanwhile(memory_id, new_text):
    edits = []

    def decider(store, *args):
        out = decide(store, *args)
        if not edits:  # the user's PATCH lands while the first pass decides
            edits.append(store.update("u", memory_id, text=new_text))
        return out

    return decider


def test_an_edit_during_the_pass_is_not_superseded_by_a_decision_about_the_old_text(store):
    [lisbon] = store.add("u", texts=["I live in Lisbon."], slots=[slot_of("I live in Lisbon.")])
    store.log_turns("u", [{"role": "user", "content": "I moved to Berlin."}])
    worker = FormationWorker(
        store, RuleExtractor(), decider=edited_meanwhile(lisbon.id, "My favourite colour is blue.")
    )
    worker.form_user("u")
    assert served(store) == ["My favourite colour is blue."]  # nothing written; the turn stays pending
    assert store.formation_counts("u").pending == 1 and worker.stats.stale_total == 1
    worker.form_user("u")  # the next pass decides over the edit: a move retires no colour
    assert served(store) == ["I moved to Berlin.", "My favourite colour is blue."]


def test_a_fact_joined_to_a_memory_edited_meanwhile_is_not_lost(store):
    [lisbon] = store.add("u", texts=["I live in Lisbon."], slots=[slot_of("I live in Lisbon.")])
    store.log_turns("u", [{"role": "user", "content": "I live in Lisbon."}])
    worker = FormationWorker(
        store, RuleExtractor(), decider=edited_meanwhile(lisbon.id, "My favourite colour is blue.")
    )
    worker.form_user("u")  # stale: nothing written, the turn stays pending
    assert store.formation_counts("u").pending == 1
    worker.form_user("u")
    # decided again over what is there now: the restatement is a memory of its own, beside the edit
    assert served(store) == ["I live in Lisbon.", "My favourite colour is blue."]
    assert worker.stats.stale_total == 1


# ---- the second review of these fixes -------------------------------------------------------------------


def test_prompt_longer_than_context_is_permanent_not_store_error(tiny_model_dir, tmp_path, store):
    """self_generate's docstring: 'a prompt the pool or the context can never hold is permanent'."""
    backend = load_backend(tiny_model_dir, tmp_path / "data")
    try:
        backend.max_context_tokens = 200  # the context cannot hold this turn's formation prompt
        long = "I live in Lisbon and I like " + " ".join(f"apples{i}" for i in range(300)) + "."
        store.log_turns("u", [{"role": "user", "content": long}])
        generate = backend_generate(backend)
        try:
            generate([{"role": "user", "content": long}], {"type": "object"}, 8)
            raised = None
        except BaseException as e:  # noqa: BLE001
            raised = e
        worker = run_passes(store, ModelExtractor(generate, max_tokens=16, decide_max_tokens=4), 4)
        counts = store.formation_counts("u")
        assert isinstance(raised, ExtractionError) and not raised.transient, repr(raised)
        assert (counts.pending, counts.dead) == (0, 1), (counts, worker.stats.last_error_kind)
    finally:
        asyncio.run(backend.aclose())


def test_a_request_queued_but_not_started_when_the_loop_closes_is_told(tiny_model_dir, tmp_path):
    """fe9b712: 'a request the closing model loop drops is told (BackendError), so a formation row's
    generate never waits on its inbox forever'. A request still in the loop's _incoming when it closes is
    closed unstarted: its finally never runs."""
    backend = load_backend(tiny_model_dir, tmp_path / "data")
    loop = backend._loop
    busy = loop.call_soon(lambda: time.sleep(3.0))  # the model thread is in a build/call for 3 s
    generate = backend_generate(backend)
    outcome = []

    def run():
        try:
            outcome.append(generate([{"role": "user", "content": "hi"}], {"type": "object"}, 8))
        except BaseException as e:  # noqa: BLE001
            outcome.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not any(not isinstance(j, tuple) for j in list(loop._incoming)):
        time.sleep(0.01)
    assert any(not isinstance(j, tuple) for j in list(loop._incoming)), "the request never reached the loop"
    asyncio.run(backend.aclose())  # the server shuts down while the request waits for its first turn
    busy.result(10)
    thread.join(10)
    assert not thread.is_alive(), "generate() still waiting 10 s after the backend closed"


class CountingExtractor(RuleExtractor):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def extract(self, turns):
        self.calls += 1
        return super().extract(turns)


def test_a_user_written_to_during_every_pass_is_retried_at_once_forever(store):
    """A client that adds a memory (POST /v1/memories) about as often as a pass takes: every pass is stale,
    is retried at once (no backoff, no bound), and re-runs the extractor (a model call for `self`) each time;
    the turn is never formed."""
    store.log_turns("u", [{"role": "user", "content": "I moved to Berlin."}])
    n = [0]

    def decider(st, *args):
        out = decide(st, *args)
        n[0] += 1
        st.add("u", texts=[f"note {n[0]}"])  # the client's write lands while the pass decides
        return out

    extractor = CountingExtractor()
    clock = FakeClock()  # no time passes: only a due user runs
    worker = FormationWorker(store, extractor, clock=clock, decider=decider)
    worker.submit("u")
    for _ in range(50):
        worker.run_once()
    pending = store.formation_counts("u").pending
    # the first stale pass is retried at once; the second backs off (no time passes here)
    assert (worker.stats.stale_total, extractor.calls, pending) == (2, 2, 1)


class Wall:
    def __init__(self):
        self.now = datetime(2026, 12, 1, 12, 0, tzinfo=timezone.utc)

    def __call__(self):
        return self.now


class Flaky:
    name = "x"

    def __init__(self):
        self.calls = 0

    def extract(self, turns):
        self.calls += 1
        if self.calls == 1:
            raise ExtractionError("down", transient=True, kind="timeout")
        raise RuntimeError("not an extraction error")  # a probe that fails otherwise


def test_a_reopened_circuit_reports_when_its_next_probe_is(store):
    clock, wall = FakeClock(), Wall()
    worker = FormationWorker(
        store, Flaky(), FormationConfig(circuit_failures=1, retry_backoff_s=2.0), clock=clock, wall_clock=wall
    )
    store.log_turns("u", [{"role": "user", "content": "I live in Lisbon."}])
    worker.submit("u")
    worker.run_once()  # circuit opens for 2 s
    first = worker.stats.circuit_until
    clock.now += 10.0
    wall.now += timedelta(seconds=10)
    worker.run_once()  # the probe fails otherwise: open again, twice as long (4 s)
    assert worker._circuit_until == clock.now + 4.0
    assert worker.stats.circuit_until == utc_text(wall.now + timedelta(seconds=4)) != first


class SlowScanStore:
    def __init__(self, store):
        self._s = store

    def __getattr__(self, name):
        return getattr(self._s, name)

    def users_with_pending_turns(self):
        time.sleep(0.3)
        return self._s.users_with_pending_turns()


def test_two_concurrent_starts_run_one_worker(store):
    worker = FormationWorker(SlowScanStore(store), RuleExtractor())
    ts = [threading.Thread(target=worker.start) for _ in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    try:
        threads = [t for t in threading.enumerate() if t.name == "kvmem-formation"]
        assert len(threads) == 1, len(threads)
    finally:
        worker.stop()
        with worker._cond:
            worker._stop = True
            worker._cond.notify_all()
        time.sleep(0.5)


def _restated(tmp_path, head):
    with MemoryStore(tmp_path / f"m{head}.sqlite") as store:  # the server's default embedder
        worker = FormationWorker(store, make_extractor("rules"), decider=partial(decide, change_head=head))
        for i, text in enumerate(
            ["So we left Brisbane lol. Living in Hobart now.", "We finally left Brisbane."]
        ):
            store.log_turns(
                "u", [{"role": "user", "content": text, "chat_time": f"2026-0{i + 3}-02T09:00:00.000000Z"}]
            )
            worker.form_user("u")
        rows = store.list("u", state="all", include_superseded=True, page_size=100).items
        return sorted(m.text for m in rows if m.superseded_by is not None or m.valid_to is not None)


def test_a_restated_move_retires_nothing(tmp_path):
    assert _restated(tmp_path, None) == []  # rules alone: a near-duplicate, joined to the memory
    assert _restated(tmp_path, "shipped") == [], "the shipped head retired the memory its restatement repeats"


# ---- the third review ----------------------------------------------------------------------------------


def writing_decider(store):
    def decider(st, *args):
        out = decide(st, *args)
        st.add("u", texts=["note"])  # the client's write lands while the pass decides
        return out

    return decider


def test_stale_count_forgotten_when_user_deleted(store):
    """A user whose pass went stale and who is then deleted (DELETE /v1/memories: delete_user + forget)
    keeps an entry in _stale forever: one per such user, never popped."""
    store.log_turns("u", [{"role": "user", "content": "I moved to Berlin."}])
    worker = FormationWorker(store, RuleExtractor(), clock=FakeClock(), decider=writing_decider(store))
    worker.submit("u")
    worker.run_once()  # stale
    store.delete_user("u")
    worker.forget("u")
    worker.submit("u")
    worker.run_once()  # no pending turns: nothing to form
    assert "u" not in worker._stale, worker._stale


class FailThenRules(RuleExtractor):
    """Extracts; a permanent failure on the second call (a malformed reply)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def extract(self, turns):
        self.calls += 1
        if self.calls == 2:
            raise ExtractionError("bad", transient=False, kind="malformed_reply")
        return super().extract(turns)


def test_stale_count_survives_a_dead_letter(store):
    """Stale once, then the retry's turn is dead-lettered: the pass ended, yet the count stays; the user's
    next stale pass (a new turn, much later) is not retried at once but backs off."""
    store.log_turns("u", [{"role": "user", "content": "I moved to Berlin."}])
    clock = FakeClock()
    n = [0]

    def decider(st, *args):
        out = decide(st, *args)
        n[0] += 1
        if n[0] in (1, 2):
            st.add("u", texts=[f"note {n[0]}"])
        return out

    worker = FormationWorker(store, FailThenRules(), clock=clock, decider=decider)
    worker.submit("u")
    worker.run_once()  # stale (1): retried at once
    worker.run_once()  # permanent failure: dead-lettered
    assert store.formation_counts("u").dead == 1
    clock.now += 3600
    store.log_turns("u", [{"role": "user", "content": "I moved to Paris."}])
    worker.submit("u")
    worker.run_once()  # stale again: the first in a row of this new pass
    # the first stale pass in a row is retried at once (not before + 0)
    assert worker._queue.get("u") == clock.now, (worker._stale, worker._queue, clock.now)


class Broken:
    """The extractor went down (transient) `down` times, then each probe fails otherwise (a store error)."""

    name = "x"

    def __init__(self, down):
        self.calls, self.down = 0, down

    def extract(self, turns):
        self.calls += 1
        if self.calls <= self.down:
            raise ExtractionError("down", transient=True, kind="timeout")
        raise RuntimeError("the store is failing")


def test_reopened_circuit_is_not_shorter_than_before(store):
    store.log_turns("u", [{"role": "user", "content": "I live in Lisbon."}])
    clock = FakeClock()
    worker = FormationWorker(
        store, Broken(5), FormationConfig(circuit_failures=1, retry_backoff_s=2.0), clock=clock
    )
    worker.submit("u")
    waits = []
    for _ in range(6):
        before = clock.now
        worker.run_once()
        waits.append(worker._circuit_until - before)
        clock.now = max(worker._circuit_until, max(worker._queue.values()))
    # 2, 4, 8, 16, 32 s after 5 extractor failures in a row; a probe that fails otherwise re-opens it "longer"
    assert waits[:5] == [2, 4, 8, 16, 32]
    assert waits[5] >= 32, waits


def test_many_failed_probes_do_not_kill_the_worker(store):
    """The store fails for days while the circuit is open: every probe fails; 2**probes_failed overflows a
    float at 1024 and the OverflowError escapes _pass (the formation thread ends; the user is not requeued)."""
    store.log_turns("u", [{"role": "user", "content": "I live in Lisbon."}])
    clock = FakeClock()
    worker = FormationWorker(store, Broken(1), FormationConfig(circuit_failures=1), clock=clock)
    worker.submit("u")
    for i in range(1100):
        try:
            worker.run_once()
        except OverflowError as e:
            raise AssertionError(f"probe {i}: {e!r}; queued: {dict(worker._queue)}") from e
        clock.now += 301
    assert "u" in worker._queue and worker._circuit_wait == 300.0  # still queued, the wait at its cap

"""The formation worker under pressure (wave 4 review): a decision that fails the same way every time is
bisected and dead-lettered, not retried forever; a half-open circuit whose probe fails otherwise opens again
instead of spinning; a stop that times out and a start never run two workers; a batch the engine's pool can
never hold is dead-lettered, not retried forever (serving/background/self_generate.py maps the refusal)."""

from __future__ import annotations

import asyncio
import json
import threading
import time

from kvmem.formation.errors import ExtractionError
from kvmem.formation.rules import RuleExtractor, slot_of
from kvmem.formation.self_model import ModelExtractor
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

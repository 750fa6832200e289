"""The application of the "self" extractor's decisions (kvmem/formation/self_model.py) by the formation worker
over a real store. This test checks the APPLICATION only: the model's replies are given JSON (a scripted
`generate`), so what is asserted is that add, update, delete and none are applied exactly as decided, and that
the rules' guard keeps chit-chat from the model. The model's own replies are tested in
tests/serving/background/test_self_extractor.py with the real default model."""

from __future__ import annotations

import json

import pytest

from kvmem.formation.self_model import FACTS_SCHEMA, ModelExtractor, update_schema
from scheduler.formation import FormationWorker


class Script:
    """Given replies, in order; records what each call was shown (its last message) and its schema."""

    def __init__(self, *replies: dict) -> None:
        self.replies = [json.dumps(r) for r in replies]
        self.calls: list[tuple[str, dict]] = []

    def __call__(self, messages, schema, max_tokens):
        self.calls.append((messages[-1]["content"], schema))
        return self.replies.pop(0), "stop"


def fact(text: str) -> dict:
    return {"text": text, "kind": "fact", "subject": None, "attribute": None, "value": None, "date": None}


def worker_with(store, script) -> FormationWorker:
    extractor = ModelExtractor(script)
    return FormationWorker(store, extractor, decider=extractor.decide)


def served(store, user="u"):
    return sorted(m.text for m in store.list(user, page_size=100).items)


def test_add_update_delete_and_none_are_applied_exactly_as_decided(store) -> None:
    kept = store.add("u", texts=["I work at Acme.", "I have a dog called Rex.", "I live in Lisbon."])
    acme, rex, lisbon = (m.id for m in kept)
    turns = store.log_turns(
        "u",
        [
            {
                "role": "user",
                "content": "I quit Acme and joined Globex. Rex died. I live in Lisbon. I play chess.",
            }
        ],
    )
    script = Script(
        {
            "facts": [
                fact("I work at Globex"),
                fact("I no longer have a dog"),
                fact("I live in Lisbon"),
                fact("I play chess"),
            ]
        },
    )
    shown: dict[str, list[str]] = {}

    def decisions(messages, schema, max_tokens):
        text = messages[-1]["content"]
        memories = [line.split(". ", 1)[1] for line in text.split("\n")[1:-1]]
        new = text.rsplit("New fact: ", 1)[1]
        shown[new] = memories
        assert schema == update_schema(len(memories))
        target = {
            "I work at Globex": ("update", "I work at Acme."),
            "I no longer have a dog": ("delete", "I have a dog called Rex."),
            "I live in Lisbon": ("none", "I live in Lisbon."),
            "I play chess": ("add", None),
        }[new]
        number = None if target[1] is None else memories.index(target[1])
        return json.dumps({"event": target[0], "memory": number}), "stop"

    extractor = ModelExtractor(lambda m, s, n: script(m, s, n) if s is FACTS_SCHEMA else decisions(m, s, n))
    worker = FormationWorker(store, extractor, decider=extractor.decide)
    result = worker.form_user("u")
    assert (result.num_turns, result.num_added, result.num_superseded, result.num_duplicates) == (1, 3, 2, 1)
    assert all(len(m) <= 3 for m in shown.values())  # the few most similar current memories
    assert served(store) == [
        "I live in Lisbon.",
        "I no longer have a dog.",
        "I play chess.",
        "I work at Globex.",
    ]
    by_text = {m.text: m for m in store.list("u", page_size=100).items}
    assert store.get("u", acme).superseded_by == by_text["I work at Globex."].id  # update
    assert store.get("u", rex).superseded_by == by_text["I no longer have a dog."].id  # delete
    assert by_text["I no longer have a dog."].metadata["kind"] == "event"
    assert by_text["I work at Globex."].metadata["kind"] == "fact"
    assert store.get("u", lisbon).source_turn_ids == (turns[0].id,)  # none: a restatement
    assert store.get("u", lisbon).superseded_by is None


def test_the_rules_guard_keeps_chit_chat_and_questions_from_the_model(store) -> None:
    script = Script()
    store.log_turns(
        "u", [{"role": "user", "content": t} for t in ("hi there!", "thanks :)", "What time is it?")]
    )
    result = worker_with(store, script).form_user("u")
    assert (result.num_turns, result.num_added) == (3, 0)
    assert script.calls == [] and served(store) == []


def test_a_fact_with_no_similar_memory_is_added_without_asking(store) -> None:
    script = Script({"facts": [fact("I play chess")]})
    store.log_turns("u", [{"role": "user", "content": "I play chess."}])
    assert worker_with(store, script).form_user("u").num_added == 1
    assert len(script.calls) == 1 and served(store) == ["I play chess."]


@pytest.mark.parametrize(
    ("said", "event", "stands", "reason"),
    [
        ("I teach at the art college now.", "update", True, None),
        ("My sister teaches at the art college now.", "update", False, "another person"),
        ("I'm going to apply to the art college.", "update", False, "plan"),
        ("I didn't get the art college job.", "delete", False, "negated"),
        ("I also teach evening classes at the art college.", "update", False, "addition"),
        ("I still work at the library.", "update", False, "restatement"),
        # the same slot and value as the memory (change_guard.same_value), said with no restating word
        ("I've been working at the library for six years.", "update", False, "restatement"),
        ("We went out for a curry at the art college.", "update", False, "no change word"),
        ("I start at the art college in September.", "update", False, "plan"),  # a date still to come
    ],
)
def test_the_rules_guard_keeps_an_update_only_where_the_turn_reads_as_the_users_change(
    store, said: str, event: str, stands: bool, reason: str | None
) -> None:
    """The model decides update or delete for every turn here (scripted); the memory is superseded only where
    the turn reads as the user's own change. Otherwise the fact is added beside it, or, for a restatement,
    joined to the memory the model named; `guarded` counts the reason."""
    (library,) = store.add("u", texts=["I work at the library."])
    (turn,) = store.log_turns("u", [{"role": "user", "content": said}])
    fact_text = said.rstrip(".")
    decisions = Script({"event": event, "memory": 0})
    facts = Script({"facts": [fact(fact_text)]})
    extractor = ModelExtractor(lambda m, s, n: facts(m, s, n) if s is FACTS_SCHEMA else decisions(m, s, n))
    worker = FormationWorker(store, extractor, decider=extractor.decide)
    result = worker.form_user("u")
    assert result.num_turns == 1 and len(decisions.calls) == 1
    old = store.get("u", library.id)
    if stands:
        assert old.superseded_by is not None and served(store) == [said]
        assert extractor.guarded == {}
    elif reason == "restatement":
        assert old.superseded_by is None and served(store) == ["I work at the library."]
        assert old.source_turn_ids == (turn.id,)  # the turn joined the memory's provenance
    else:
        assert old.superseded_by is None and served(store) == sorted(["I work at the library.", said])
    if not stands:
        assert extractor.guarded == {reason: 1}
    assert extractor._said == {}  # the turns' words are not kept past their decision


@pytest.mark.parametrize(
    ("said", "named", "superseded", "reason"),
    [
        ("I moved to Porto.", "library", "Lisbon", "other slot, retargeted"),
        ("I took up pottery.", "library", None, "other slot"),
        ("I now work at the museum.", "library", "library", None),
        ("I moved to Porto.", "Lisbon", "Lisbon", None),
        ("I play the drums every weekend now.", "library", None, "other slot"),
    ],
)
def test_an_update_naming_a_memory_of_another_slot_area_is_retargeted_or_added(
    store, said: str, named: str, superseded: str | None, reason: str | None
) -> None:
    """The model (scripted) names the memory holding `named` for an update; the update stands where the fact
    and that memory set slots of one area, names the shown memory of the fact's area where there is one, and
    is an add where there is none. `guarded` counts the reason."""
    library, lisbon = store.add("u", texts=["I work at the library.", "I live in Lisbon."])
    store.log_turns("u", [{"role": "user", "content": said}])
    shown: list[str] = []

    def generate(messages, schema, max_tokens):
        if schema is FACTS_SCHEMA:
            return json.dumps({"facts": [fact(said.rstrip("."))]}), "stop"
        listed = messages[-1]["content"].split("\n")[1:-1]  # "Memories:", "0. ...", ..., "New fact: ..."
        shown.extend(listed)
        number = next(i for i, line in enumerate(listed) if named in line)
        return json.dumps({"event": "update", "memory": number}), "stop"

    extractor = ModelExtractor(generate)
    FormationWorker(store, extractor, decider=extractor.decide).form_user("u")
    assert len(shown) == 2  # both memories were shown to the model
    retired = {m.text for m in (store.get("u", library.id), store.get("u", lisbon.id)) if m.superseded_by}
    assert retired == ({f"I work at the {superseded}." if superseded == "library" else f"I live in {superseded}."}
                       if superseded else set())  # fmt: skip
    assert said in served(store)
    assert extractor.guarded == ({reason: 1} if reason else {})


@pytest.mark.parametrize(
    ("text", "cut", "atoms"),
    [
        # a copied compound: one fact per statement, the question dropped
        (
            "I've been busy with work and I start lessons again in February. Have you been busy?",
            False,
            ["I've been busy with work", "I start lessons again in February"],
        ),
        # cut by the schema's bound: the statement that ends the text is dropped when others stand
        (
            "I followed a traditional recipe with ladyfingers dipped in espresso and layered them with a",
            True,
            ["I followed a traditional recipe with ladyfingers dipped in espresso"],
        ),
        # ... but a cut text whose last statement ends before the cut keeps it
        (
            "I've been busy with work and catching up with friends. It was my",
            True,
            ["I've been busy with work and catching up with friends"],
        ),
        ("Ana has a dog named Rex.", False, ["Ana has a dog named Rex."]),  # not first person: as written
        ("He is a former cameraman and she is a", True, []),  # not first person and cut
        ("Do you like jazz?", False, []),
        ("Maybe I should learn to cook", False, []),  # a hedge the rules drop
    ],
)
def test_a_model_fact_is_split_into_the_rules_statements(text, cut, atoms) -> None:
    from kvmem.formation.self_model import atomic
    from kvmem.formation.types import Fact

    out = atomic(Fact(text=text, turn_ids=("t",), valid_from="2026-11-26T12:00:00+00:00"), cut=cut)
    assert [f.text for f in out] == atoms


@pytest.mark.parametrize(
    ("text", "cut"),
    [
        ("x" * 100, True),  # at the bound
        (
            "He's a former cameraman in Show biz and she's a former language teacher from Italy. She gives some",
            True,
        ),
        (
            "I've been busy with work and catching up with friends and family. I start lessons again on the",
            True,
        ),
        (
            "I've been busy with work and catching up with friends and family. I start lessons again soon.",
            False,
        ),
        (
            "I've been busy with work and catching up with friends and family lately, and with my new dog Miso!",
            False,
        ),
        ("I start lessons again on the", False),  # far from the bound: the model ended it
    ],
)
def test_a_text_is_cut_when_it_ends_near_the_bound_on_no_end_punctuation(text, cut) -> None:
    from kvmem.formation.self_model import was_cut

    assert was_cut(text) is cut


def test_the_slot_stays_on_the_statement_that_names_its_value() -> None:
    from kvmem.formation.self_model import atomic
    from kvmem.formation.types import Fact

    compound = Fact(
        text="I live in Lisbon with my wife Ana",
        turn_ids=("t",),
        valid_from="2026-11-26T12:00:00+00:00",
        slot="user|home_city",
        value="lisbon",
    )
    assert [(f.text, f.slot, f.value) for f in atomic(compound, cut=False)] == [
        ("I live in Lisbon", "user|home_city", "lisbon"),
        ("My wife is Ana", None, None),
    ]


def test_a_compound_reply_is_stored_as_atomic_memories(store) -> None:
    """The small models copy the user's sentences into one fact; what the worker stores is one memory per
    statement (a later move must never retire the spouse's name with the city)."""
    said = "I live in Lisbon with my wife Ana. I work as a nurse."
    script = Script({"facts": [fact(said)]})
    store.log_turns("u", [{"role": "user", "content": said}])
    assert worker_with(store, script).form_user("u").num_added == 3
    assert served(store) == ["I live in Lisbon.", "I work as a nurse.", "My wife is Ana."]


def test_a_reply_that_parses_but_ended_with_length_is_refused_as_cut() -> None:
    from kvmem.formation.errors import ExtractionError
    from kvmem.formation.types import Fact, TurnInput

    said = "2026-11-26T12:00:00.000000Z"
    turn = TurnInput(id="t1", role="user", text="I play chess.", chat_time=said)
    # the engine closes a reply that runs into max_tokens (its last fact may be cut short): it parses
    closed = ModelExtractor(
        lambda messages, schema, max_tokens: (json.dumps({"facts": [fact("I pl")]}), "length")
    )
    with pytest.raises(ExtractionError) as cut:
        closed.extract([turn])
    assert (cut.value.kind, cut.value.transient) == ("length", False)
    decided = ModelExtractor(
        lambda messages, schema, max_tokens: (json.dumps({"event": "add", "memory": None}), "length")
    )
    with pytest.raises(ExtractionError) as undecided:
        decided.decide_one(Fact("I play chess.", ("t1",), said), [("m1", "I play go.")])
    assert (undecided.value.kind, undecided.value.transient) == ("length", False)

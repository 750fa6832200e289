"""Formation over a log that names its speakers, and the session a formed memory is filed under
(scheduler/formation_speakers.py): each speaker's facts are decided against that speaker's memories only, every
memory keeps who said it and the session it was said in, and a session's delete takes what was formed from it."""

from __future__ import annotations

import json

import pytest

from kvmem.formation.rules import RuleExtractor
from kvmem.formation.self_model import FACTS_SCHEMA, ModelExtractor
from kvmem.text import MemoryStore
from kvmem.text.errors import InvalidMemoryInput
from kvmem.text.records import FormedMemory
from scheduler.formation import FormationWorker
from scheduler.formation_speakers import SpeakerView, memory_speaker


def log(
    store: MemoryStore, user: str, lines: list[tuple[str | None, str]], session: str | None = None
) -> None:
    store.log_turns(
        user,
        [{"role": "user", "content": text, **({"name": name} if name else {})} for name, text in lines],
        session_id=session,
    )


def served(store: MemoryStore, user: str = "chat") -> list[tuple[str, str | None]]:
    return sorted((m.text, memory_speaker(m)) for m in store.list(user, page_size=100).items)


def test_one_speakers_move_never_retires_anothers_home(store: MemoryStore) -> None:
    worker = FormationWorker(store, RuleExtractor())
    log(store, "chat", [("Kate", "I live in Boston."), ("Emi", "I live in Denver.")])
    worker.form_user("chat")
    assert served(store) == [("I live in Boston.", "Kate"), ("I live in Denver.", "Emi")]
    log(store, "chat", [("Emi", "I moved to Chicago.")])
    result = worker.form_user("chat")
    assert result.num_superseded == 1
    assert served(store) == [("I live in Boston.", "Kate"), ("I moved to Chicago.", "Emi")]
    denver = next(m for m in store.list("chat", include_superseded=True).items if "Denver" in m.text)
    chicago = next(m for m in store.list("chat").items if "Chicago" in m.text)
    assert denver.superseded_by == chicago.id


def test_the_same_words_from_two_speakers_are_two_memories_and_a_search_naming_one_finds_theirs(
    store: MemoryStore,
) -> None:
    worker = FormationWorker(store, RuleExtractor())
    log(store, "chat", [("Kate", "I love hiking."), ("Emi", "I love hiking.")])
    assert worker.form_user("chat").num_added == 2
    log(store, "chat", [("Kate", "I love hiking.")])
    result = worker.form_user("chat")
    assert (result.num_added, result.num_duplicates) == (0, 1)  # Kate's memory said again
    assert served(store) == [("I love hiking.", "Emi"), ("I love hiking.", "Kate")]
    for name in ("Emi", "Kate"):
        [top, _] = store.search("chat", f"What does {name} love?", top_k=2)
        assert memory_speaker(top.memory) == name
    # the cached rows hold the speaker as a reload of the store does
    store._vectors.invalidate("chat")
    for name in ("Emi", "Kate"):
        [top, _] = store.search("chat", f"What does {name} love?", top_k=2)
        assert memory_speaker(top.memory) == name


def test_the_users_own_chat_is_decided_as_before_and_names_nobody(store: MemoryStore) -> None:
    worker = FormationWorker(store, RuleExtractor())
    log(store, "u", [(None, "I live in Lisbon.")])
    log(store, "u", [("Kate", "I live in Boston.")])  # an import into the same user: someone else's
    worker.form_user("u")
    log(store, "u", [(None, "I moved to Berlin.")])
    assert worker.form_user("u").num_superseded == 1
    assert served(store, "u") == [("I live in Boston.", "Kate"), ("I moved to Berlin.", None)]
    [berlin] = [m for m in store.list("u").items if "Berlin" in m.text]
    assert berlin.metadata == {"kind": "fact", "extractor": "rules"}  # no speaker key for the user's own


def test_a_formed_memory_is_filed_under_its_session_and_goes_with_its_delete(store: MemoryStore) -> None:
    worker = FormationWorker(store, RuleExtractor())
    log(store, "u", [(None, "I live in Lisbon with my wife Ana.")], session="s1")
    log(store, "u", [(None, "My dog is called Rex.")], session="s2")
    log(store, "u", [(None, "I play the cello.")])
    worker.form_user("u")
    sessions = {m.text: m.session_id for m in store.list("u", page_size=100).items}
    assert sessions == {
        "I live in Lisbon.": "s1",
        "My wife is Ana.": "s1",
        "My dog is called Rex.": "s2",
        "I play the cello.": None,
    }
    assert store.delete_session("u", "s1") == 2
    assert [m.text for m in store.list("u", page_size=100).items] == [
        "I play the cello.",
        "My dog is called Rex.",
    ]


def test_a_speaker_view_keeps_only_that_speakers_memories(store: MemoryStore) -> None:
    worker = FormationWorker(store, RuleExtractor())
    log(store, "chat", [("Kate", f"I like sport number {i}.") for i in range(6)] + [("Emi", "I like sport.")])
    worker.form_user("chat")
    emi = SpeakerView(store, "Emi")
    hits = emi.search("chat", "I like sport number 3.", top_k=2, mode="dense")
    assert [h.memory.text for h in hits] == ["I like sport."]  # Kate's nearer ones left out, though asked 2
    assert [
        memory_speaker(h.memory) for h in SpeakerView(store, "Kate").search("chat", "sport", top_k=3)
    ] == ["Kate"] * 3
    assert emi.embedder is store.embedder  # the rest is the store's own


def test_commit_formed_refuses_a_blank_speaker(store: MemoryStore) -> None:
    [turn] = store.log_turns("u", [{"role": "user", "content": "I live in Oslo."}])
    add = FormedMemory(
        "I live in Oslo.", (turn.id,), "2026-11-26T12:00:00Z", "2026-11-26T12:00:00Z", speaker=" "
    )
    with pytest.raises(InvalidMemoryInput, match=r"adds\[0\]\.speaker must be a non-empty string or None"):
        store.commit_formed("u", [turn.id], [add], [], [], extractor="rules")
    assert store.list("u").total == 0


def fact(text):
    return {"text": text, "kind": "fact", "subject": None, "attribute": None, "value": None, "date": None}


def self_worker(store, facts_replies, decide=None):
    replies = [json.dumps({"facts": [fact(t) for t in r]}) for r in facts_replies]

    def generate(messages, schema, max_tokens):
        if schema is FACTS_SCHEMA:
            return replies.pop(0), "stop"
        return decide(messages, schema, max_tokens)

    extractor = ModelExtractor(generate)
    return FormationWorker(store, extractor, decider=extractor.decide)


def test_deleting_a_session_keeps_the_turns_of_another_session(store) -> None:
    worker = FormationWorker(store, RuleExtractor())
    log(store, "u", [(None, "I live in Lisbon.")], session="s1")
    worker.form_user("u")
    log(store, "u", [(None, "I live in Lisbon.")], session="s2")  # said again in another session: a duplicate
    worker.form_user("u")
    assert store.delete_session("u", "s1") == 1
    assert store.list_turns("u", session_id="s2").total == 1  # s2 was not deleted
    assert worker.form_user("u").num_added == 1  # its turn, pending again, forms the fact on its own
    assert [(m.text, m.session_id) for m in store.list("u").items] == [("I live in Lisbon.", "s2")]


# the LLM extractors cite every user turn of their batch: each fact is filed under the turn that said it
def test_self_extractor_memories_keep_their_own_speaker(store) -> None:
    worker = self_worker(store, [["I live in Boston", "I live in Denver"]])
    log(store, "chat", [("Kate", "I live in Boston."), ("Emi", "I live in Denver.")])
    worker.form_user("chat")
    assert served(store) == [("I live in Boston.", "Kate"), ("I live in Denver.", "Emi")]


def test_self_extractor_one_speakers_move_never_retires_anothers_home(store) -> None:
    shown: dict[str, list[str]] = {}

    def decide(messages, schema, max_tokens):
        text = messages[-1]["content"]
        memories = [line.split(". ", 1)[1] for line in text.split("\n")[1:-1]]
        new = text.rsplit("New fact: ", 1)[1]
        shown[new] = memories
        if "Chicago" in new and "I live in Boston." in memories:
            return json.dumps({"event": "update", "memory": memories.index("I live in Boston.")}), "stop"
        return json.dumps({"event": "add", "memory": None}), "stop"

    worker = self_worker(store, [["I live in Boston"], ["I love hiking", "I moved to Chicago"]], decide)
    log(store, "chat", [("Kate", "I live in Boston.")])
    worker.form_user("chat")
    log(store, "chat", [("Kate", "I love hiking."), ("Emi", "I moved to Chicago.")])
    worker.form_user("chat")
    assert "I live in Boston." not in shown.get("I moved to Chicago", [])  # Emi's fact shown Kate's memory
    assert ("I live in Boston.", "Kate") in served(store)


def test_self_extractor_memory_is_filed_under_its_own_session(store) -> None:
    worker = self_worker(store, [["I live in Lisbon", "My dog is called Rex"]])
    log(store, "u", [(None, "I live in Lisbon.")], session="s1")
    log(store, "u", [(None, "My dog is called Rex.")], session="s2")
    worker.form_user("u")  # one batch of two sessions' turns
    sessions = {m.text: m.session_id for m in store.list("u", page_size=100).items}
    assert sessions == {"I live in Lisbon.": "s1", "My dog is called Rex.": "s2"}


def test_self_extractor_deleting_a_session_takes_what_was_formed_from_it(store) -> None:
    worker = self_worker(store, [["I live in Lisbon", "My dog is called Rex"]])
    log(store, "u", [(None, "I live in Lisbon.")], session="s1")
    log(store, "u", [(None, "My dog is called Rex.")], session="s2")
    worker.form_user("u")
    store.delete_session("u", "s2")
    assert [m.text for m in store.list("u", page_size=100).items] == ["I live in Lisbon."]


@pytest.mark.parametrize("again", ["kate", "Kate ", " Kate"])
def test_a_speakers_move_retires_their_home_whatever_the_case_or_spacing_of_their_name(store, again) -> None:
    worker = FormationWorker(store, RuleExtractor())
    log(store, "chat", [("Kate", "I live in Boston.")])
    worker.form_user("chat")
    log(store, "chat", [(again, "I moved to Chicago.")])
    assert worker.form_user("chat").num_superseded == 1

"""The vector a formed memory is searched by (kvmem/text/conversation/context.py): its fact's, leaning toward the
turns it was formed from, written by commit_formed and kept by a re-embedding; what is served stays the fact."""

from __future__ import annotations

from datetime import datetime, timezone

import numpy as np

from kvmem.formation.rules import RuleExtractor
from kvmem.text import HashEmbedder, MemoryStore, TextStoreConfig
from kvmem.text.conversation.context import CONTEXT_WEIGHT
from scheduler.formation import FormationWorker

TURN = (
    "Sorry for the delay, the football match went on forever! I live in Lisbon and I am allergic to peanuts."
)
OTHER = "My sister is called Ana."
MOMENT = datetime(2026, 11, 26, 12, 0, tzinfo=timezone.utc)


def stored_vectors(store: MemoryStore, user: str = "u") -> dict[str, np.ndarray]:
    rows = store._conn().execute(
        "SELECT m.text, v.vec FROM memories m JOIN memory_vectors v ON v.rowid = m.rowid WHERE m.user_id = ?",
        (user,),
    )
    return {text: np.frombuffer(vec, dtype="<f4") for text, vec in rows}


def expected(embedder, fact: str, turns: list[str]) -> np.ndarray:
    """unit(e(fact) + CONTEXT_WEIGHT * mean e(turn)), computed here from the embedder alone."""
    vector = embedder.embed([fact])[0].astype(np.float64)
    if turns:
        vector = vector + CONTEXT_WEIGHT * embedder.embed(turns).astype(np.float64).mean(axis=0)
    return (vector / np.linalg.norm(vector)).astype(np.float32)


def formed_store(path, embedder) -> MemoryStore:
    store = MemoryStore(path, embedder=embedder, clock=lambda: MOMENT)
    store.log_turns("u", [{"role": "user", "content": TURN}, {"role": "user", "content": OTHER}])
    FormationWorker(store, RuleExtractor()).form_user("u")
    return store


def test_a_formed_memory_is_kept_with_its_turn_in_its_vector_and_served_as_its_fact(tmp_path) -> None:
    embedder = HashEmbedder()
    store = formed_store(tmp_path / "m.sqlite", embedder)
    served = {m.text: m for m in store.list("u").items}
    assert sorted(served) == ["I am allergic to peanuts.", "I live in Lisbon.", "My sister is called Ana."]
    vectors = stored_vectors(store)
    for text, memory in served.items():
        turn = TURN if "Ana" not in text else OTHER
        assert len(memory.source_turn_ids) == 1
        np.testing.assert_allclose(vectors[text], expected(embedder, text, [turn]), rtol=0, atol=1e-6)
    # the cache serves what the file holds
    store._vectors.invalidate("u")
    again = store.search("u", "football match delay", top_k=3, mode="dense")
    assert [h.memory.text for h in again][2] == "My sister is called Ana."
    store.close()


def test_a_question_about_the_turn_finds_the_fact_its_words_miss(tmp_path) -> None:
    store = formed_store(tmp_path / "m.sqlite", HashEmbedder())
    # "the football match" shares no word with "I live in Lisbon." or "I am allergic to peanuts.", only with the
    # turn they were formed from; the sister's memory came from another turn
    hits = store.search("u", "the football match went on", top_k=3, mode="dense")
    assert [h.memory.text for h in hits][2] == "My sister is called Ana."
    assert min(h.score for h in hits[:2]) > 0.3 > hits[2].score  # by the fact's own words, all three 0.0
    store.close()


def test_an_edited_formed_memory_is_searched_by_its_own_words(tmp_path) -> None:
    embedder = HashEmbedder()
    store = formed_store(tmp_path / "m.sqlite", embedder)
    lisbon = next(m for m in store.list("u").items if "Lisbon" in m.text)
    store.update("u", lisbon.id, text="I live in Porto.")
    np.testing.assert_allclose(
        stored_vectors(store)["I live in Porto."], embedder.embed(["I live in Porto."])[0], rtol=0, atol=1e-6
    )
    store.close()


def test_a_store_re_embedded_for_another_embedder_keeps_the_turns_in_formed_vectors(tmp_path) -> None:
    path = tmp_path / "m.sqlite"
    formed_store(path, HashEmbedder(64)).close()
    other = HashEmbedder(32)
    store = MemoryStore(path, embedder=other, config=TextStoreConfig(reembed_on_mismatch=True))
    vectors = stored_vectors(store)
    assert set(vectors) == {"I am allergic to peanuts.", "I live in Lisbon.", "My sister is called Ana."}
    for text, vector in vectors.items():
        turn = TURN if "Ana" not in text else OTHER
        np.testing.assert_allclose(vector, expected(other, text, [turn]), rtol=0, atol=1e-6)
    store.add("u", text="I like tea.")  # a memory added directly: its own words
    np.testing.assert_allclose(
        stored_vectors(store)["I like tea."], other.embed(["I like tea."])[0], rtol=0, atol=1e-6
    )
    store.close()

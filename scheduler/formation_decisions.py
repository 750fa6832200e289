"""What a formation pass's facts do to a user's current memories: for a batch of facts, the candidate memories
(those of the slots the facts set or clear, and the nearest by embedding), consolidation's decisions over them
(kvmem.formation.consolidate), and the rows the store commits (adds, duplicates, supersessions, and facts said
before a newer memory of their slot, added already superseded). Pure but for the store's reads and one
embedding call; the worker (formation.py) owns when and for whom it runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from kvmem.formation.consolidate import DEFAULT_CLEARS, ExistingMemory, batch_ref, consolidate_batch
from kvmem.formation.types import Fact


def slots_touched(fact: Fact) -> tuple[str, ...]:
    """The slots a fact may supersede: its own, and those its value clears (consolidate.DEFAULT_CLEARS; a
    name ending in '|' is a prefix: every slot of that subject)."""
    if not fact.slot:
        return ()
    cleared = [c for r in DEFAULT_CLEARS if r.slot == fact.slot and fact.value in r.values for c in r.clears]
    return (fact.slot, *cleared)


def as_sentence(text: str) -> str:
    """A memory's text as a sentence: extractors return clauses ("I live in Lisbon"); a memory line reads
    better, and tokenizes like the memories users add, with its full stop."""
    text = text.strip()
    return text if not text or text[-1] in ".!?" else text + "."


def decide(
    store: Any, user_id: str, facts: list[Fact], said: dict[str, str], num_dense_candidates: int
) -> tuple[list[Any], list[Any], list[Any], list[tuple[int, str]]]:
    """Decisions for the batch against the user's served memories with the slots the facts set (or clear)
    and the nearest ones by embedding; returns commit_formed's adds, duplicates, supersessions and
    outdated (a fact said before a newer memory of its slot: added already superseded by it).

    Which of two statements is newer goes by when each was said (`said`: turn id -> chat_time; a
    memory's chat_time), not by the date a fact names: "I moved to Berlin last month" said today retires
    "I live in Lisbon" said last week."""
    from kvmem.text.records import FormedMemory

    if not facts:
        return [], [], [], []
    existing: dict[str, ExistingMemory] = {}

    def consider(m: Any) -> None:
        existing.setdefault(
            m.id,
            ExistingMemory(
                m.id, m.text, m.slot, m.slot_value, m.valid_from or m.chat_time, said_at=m.chat_time
            ),
        )

    for slot in sorted({s for f in facts for s in slots_touched(f)}):
        for m in store.slot_candidates(user_id, slot.rstrip("|"), prefix=slot.endswith("|")):
            consider(m)
    for fact in facts:
        for hit in store.search(user_id, fact.text, top_k=num_dense_candidates, mode="dense"):
            consider(hit.memory)
    similarity = _similarity(store, [f.text for f in facts], [e.text for e in existing.values()])
    said_at = [max(said.get(t, "") for t in f.turn_ids) for f in facts]
    batch = consolidate_batch(facts, list(existing.values()), similarity, said_at=said_at)
    adds: list[Any] = []
    index_of: dict[int, int] = {}  # fact index -> add index
    duplicates: list[tuple[str, tuple[str, ...]]] = []
    outdated: list[tuple[int, str]] = []
    for i, (fact, decision) in enumerate(zip(facts, batch.decisions, strict=True)):
        if decision.kind == "duplicate":
            # a duplicate of a fact of this batch adds nothing; of a stored memory, its turns
            duplicates.extend((t, fact.turn_ids) for t in decision.target_ids if t in existing)
            continue
        if decision.kind == "outdated":
            outdated.append((len(adds), decision.target_ids[0]))
        index_of[i] = len(adds)
        adds.append(
            FormedMemory(
                text=as_sentence(fact.text),
                source_turn_ids=fact.turn_ids,
                valid_from=fact.valid_from,
                chat_time=said_at[i] or fact.valid_from,  # when it was said
                session_id=None,
                slot=fact.slot,
                slot_value=fact.value,
                kind=fact.kind,
            )
        )
    batch_index = {batch_ref(i): i for i in range(len(facts))}
    supersessions: list[tuple[str | int, int]] = []
    for s in batch.supersessions:
        if s.new_index not in index_of:
            continue
        if s.old_id in batch_index:  # an earlier fact of this batch: added already superseded
            if batch_index[s.old_id] in index_of:
                supersessions.append((index_of[batch_index[s.old_id]], index_of[s.new_index]))
        elif s.old_id in existing:
            supersessions.append((s.old_id, index_of[s.new_index]))
    return adds, duplicates, supersessions, outdated


def _similarity(store: Any, fact_texts: list[str], other_texts: list[str]) -> Callable[[str, str], float]:
    """Cosine of the store's embeddings, for the texts of this batch (one embedding call)."""
    texts = list(dict.fromkeys([*fact_texts, *other_texts]))
    if not texts:
        return lambda a, b: 0.0
    vectors = store.embedder.embed(texts)  # [n, dim], unit rows
    row = {t: i for i, t in enumerate(texts)}

    def cosine(a: str, b: str) -> float:
        if a not in row or b not in row:
            return 0.0
        return float(np.dot(vectors[row[a]], vectors[row[b]]))

    return cosine

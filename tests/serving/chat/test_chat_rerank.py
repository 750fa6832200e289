"""The chat path uses search's reranked order: the text part of the prompt and the hits that feed heat come in the
order the second stage gave (fake backend; the store's reranker swapped for one whose order is known)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from fastapi.testclient import TestClient

from kvmem.text.search.rerank import write_weights
from kvmem.text.search.rerank_features import FEATURES
from tests.serving.conftest import ALICE, MODEL, make_stack

TEXTS = (
    "alice plays the cello every night",
    "the cello alice plays is old",
    "does alice still play the cello?",
    "alice bought new cello strings",
)
QUERY = "what does alice play, the cello?"


def test_chat_text_part_and_heat_follow_the_reranked_order(tmp_path: Path) -> None:
    stack = make_stack(tmp_path, retrieve_top_k=4, store_turns=False)
    store = stack.store
    ids = {m.text: m.id for m in store.add("alice", texts=list(TEXTS))}
    store.config = dataclasses.replace(store.config, rerank="none")
    first = [h.memory.id for h in store.search("alice", QUERY, top_k=4)]
    weights = tmp_path / "questions_first.json"  # one stump: a question outranks every statement
    write_weights(
        weights, "stumps", {"base": 0.0, "stumps": [[FEATURES.index("is_question"), 0.5, -3.0, 3.0]]}, {}
    )
    store.config = dataclasses.replace(store.config, rerank="ltr", rerank_weights=str(weights))
    reranked = [h.memory.id for h in store.search("alice", QUERY, top_k=4)]
    question = ids["does alice still play the cello?"]
    assert reranked[0] == question and first[0] != question
    assert reranked[1:] == [i for i in first if i != question]  # ties keep the first stage's order
    with TestClient(stack.app) as client:
        body = {"model": MODEL, "messages": [{"role": "user", "content": QUERY}]}
        out = client.post("/v1/chat/completions", json=body, headers=ALICE).json()
    assert out["memory"]["used"] == [{"id": i, "tier": "text"} for i in reranked]
    [request] = stack.backend.requests
    assert list(request.memory_ids) == reranked
    stack.scheduler.stop()

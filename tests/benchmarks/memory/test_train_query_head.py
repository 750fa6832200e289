"""train_query_head: the recipe is deterministic, and the shipped head reproduces its recorded recall."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from benchmarks.memory.conversations import Conversation, Question, Session, Turn, load_conversation
from benchmarks.memory.recall_bench import DEFAULT_DATA_DIR, CachedEmbedder
from benchmarks.memory.train_query_head import Chat, dense_recall, load_chat, query_vectors, train
from kvmem.text.search.embedders import OnnxMiniLMEmbedder, default_embedder

RESULTS = (
    Path(__file__).resolve().parents[3] / "benchmarks/results/cpu/recall_bench/query_head_train_tune.json"
)
CHAT = "Chat_1_Emi_Elise"  # the shortest tune chat


def _synthetic_chat(name: str, seed: int) -> Chat:
    rng = np.random.default_rng(seed)
    turns = tuple(Turn(f"D1:{i}", "a", f"t{i}", "") for i in range(1, 31))
    questions = tuple(Question(f"q{i}", (f"D1:{i}", f"D1:{i + 1}"), "1", 0) for i in range(1, 9))
    conversation = Conversation(name, (Session("s1", turns),), questions)
    memory = rng.normal(size=(30, 384)).astype(np.float32)
    memory /= np.linalg.norm(memory, axis=1, keepdims=True)
    states = [rng.normal(size=(int(rng.integers(3, 9)), 384)).astype(np.float32) for _ in questions]
    return Chat(conversation, memory, states)


def test_training_is_deterministic_and_moves_the_head():
    chats = [_synthetic_chat("a", 0), _synthetic_chat("b", 1)]
    first, second = train(chats), train(chats)
    for name in ("l1_weight", "l1_bias", "l2_weight", "l2_bias"):
        np.testing.assert_array_equal(getattr(first, name), getattr(second, name))
    assert np.abs(first.l2_weight).max() > 0  # l2 starts at zero (mean pooling) and was trained
    assert dense_recall(chats[0], query_vectors(first, chats[0])) != dense_recall(
        chats[0], query_vectors(None, chats[0])
    )


@pytest.mark.skipif(
    not (DEFAULT_DATA_DIR / f"{CHAT}.json").is_file(), reason=f"REALTALK not fetched into {DEFAULT_DATA_DIR}"
)
def test_the_shipped_head_reproduces_its_recorded_dense_recall_on_a_tune_chat():
    recorded = json.loads(RESULTS.read_text())
    base = OnnxMiniLMEmbedder(num_threads=1, use_query_head=False)
    chat = load_chat(load_conversation(DEFAULT_DATA_DIR / f"{CHAT}.json"), CachedEmbedder(base, None), base)
    shipped = default_embedder().query_head
    head_recall = float(np.mean(dense_recall(chat, query_vectors(shipped, chat))))
    plain_recall = float(np.mean(dense_recall(chat, query_vectors(None, chat))))
    assert head_recall == pytest.approx(recorded["in_sample"]["by_chat"][CHAT], abs=6e-5)
    assert plain_recall == pytest.approx(recorded["mean_pooling"]["by_chat"][CHAT], abs=6e-5)

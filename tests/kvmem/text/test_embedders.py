"""The real embedder (all-MiniLM-L6-v2, int8 ONNX) and the any-model-path loader; dense retrieval quality."""

from __future__ import annotations

import numpy as np
import pytest

from kvmem.text import (
    HashEmbedder,
    MemoryStore,
    SentenceTransformerEmbedder,
    TextStoreError,
    default_embedder,
    load_embedder,
)
from kvmem.text.search.embedders import minilm_model_dir

PARAPHRASES = [
    "I adopted a beagle named Max last weekend.",
    "What's the name of my new dog?",
    "The quarterly tax filing is due on Friday.",
]


@pytest.fixture(scope="module")
def real():
    return default_embedder()


def test_default_is_shared_and_normalized(real):
    assert default_embedder() is real
    assert (real.name, real.dim) == ("all-MiniLM-L6-v2-onnx-int8", 384)
    vectors = real.embed(PARAPHRASES)
    assert vectors.shape == (3, 384) and vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert vectors[0] @ vectors[1] > 0.4 > vectors[0] @ vectors[2]
    np.testing.assert_array_equal(real.embed(PARAPHRASES[:1])[0], vectors[0])  # batching does not change rows
    assert real.embed([]).shape == (0, 384)


def test_onnx_threads_do_not_spin_between_embeds(real):
    # Spinning intra-op threads stole the model's cores on the forward right after an embed (+43 ms per request).
    real.embed(PARAPHRASES[:1])
    options = real._session.get_session_options()
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"


def test_sentence_transformers_dir_matches_onnx(real):
    fp32 = SentenceTransformerEmbedder(minilm_model_dir(), name="all-MiniLM-L6-v2")
    assert fp32.dim == 384
    a, b = fp32.embed(PARAPHRASES), real.embed(PARAPHRASES)
    cosines = (a * b).sum(axis=1)
    assert cosines.min() > 0.99, cosines


def test_load_embedder_by_name(tmp_path):
    assert load_embedder("default") is default_embedder()
    assert load_embedder("hash").name == "hash-bow-64"
    with pytest.raises(TextStoreError, match="unknown embedder 'nope'"):
        load_embedder("nope")
    with pytest.raises(TextStoreError, match="is not a model directory"):
        SentenceTransformerEmbedder(tmp_path)


def test_dense_search_finds_paraphrases_keyword_cannot(tmp_path, real):
    with MemoryStore(tmp_path / "m.db", embedder=real) as store:
        pet, sister, _ = store.add(
            "alice",
            texts=[
                "I adopted a beagle named Max last weekend.",
                "My sister Ana just moved to Lisbon for her new job.",
                "The quarterly tax filing is due on Friday.",
            ],
        )
        assert store.search("alice", "which puppy do I own?", mode="keyword") == []
        assert store.search("alice", "which puppy do I own?", mode="dense", top_k=1)[0].memory.id == pet.id
        assert (
            store.search("alice", "where does my sibling live now", mode="dense", top_k=1)[0].memory.id
            == sister.id
        )
        assert store.search("alice", "which puppy do I own?", top_k=1)[0].memory.id == pet.id


def test_hash_embedder_is_deterministic():
    e = HashEmbedder()
    np.testing.assert_array_equal(e.embed(["a b c"]), e.embed(["a b c"]))

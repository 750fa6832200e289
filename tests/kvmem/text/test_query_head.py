"""The learned query head: its file checks, its pooling, the shipped file, and how search uses its vectors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import kvmem.text.search.query_head as query_head_module
from kvmem.text import MemoryStore, default_embedder, load_embedder
from kvmem.text.search.query_head import (
    DEFAULT_HEAD_SHA256,
    QueryHead,
    QueryHeadLoadError,
    load_query_head,
    save_query_head,
)

RESULTS = (
    Path(__file__).resolve().parents[3] / "benchmarks/results/cpu/recall_bench/query_head_train_tune.json"
)


def _tensors(hidden: int = 4, dim: int = 8, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "l1.weight": rng.normal(size=(hidden, dim)).astype(np.float32),
        "l1.bias": rng.normal(size=hidden).astype(np.float32),
        "l2.weight": rng.normal(size=(1, hidden)).astype(np.float32),
        "l2.bias": np.zeros(1, dtype=np.float32),
    }


def test_a_zero_second_layer_is_mean_pooling_over_the_mask():
    tensors = _tensors()
    head = QueryHead(
        tensors["l1.weight"], tensors["l1.bias"], np.zeros((1, 4), np.float32), np.zeros(1, np.float32), ""
    )
    hidden = np.random.default_rng(1).normal(size=(2, 5, 8)).astype(np.float32)
    mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    pooled = head.pool(hidden, mask)
    for row, n in enumerate((3, 5)):
        mean = hidden[row, :n].mean(axis=0)
        np.testing.assert_allclose(pooled[row], mean / np.linalg.norm(mean), atol=1e-6)


def test_pooling_weighs_tokens_by_the_head_and_ignores_padding():
    tensors = _tensors()
    head = QueryHead(*(tensors[k] for k in ("l1.weight", "l1.bias", "l2.weight", "l2.bias")), "")
    hidden = np.random.default_rng(2).normal(size=(1, 3, 8)).astype(np.float32)
    h = hidden[0, :2]
    pre = h @ tensors["l1.weight"].T + tensors["l1.bias"]
    gelu = 0.5 * pre * (1 + np.tanh(np.sqrt(2 / np.pi) * (pre + 0.044715 * pre**3)))
    logits = gelu @ tensors["l2.weight"][0]
    weights = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
    expected = (weights[:, None] * h).sum(axis=0)
    padded = hidden.copy()
    padded[0, 2] = 1e3  # a padding position: must not count
    np.testing.assert_allclose(
        head.pool(padded, np.array([[1, 1, 0]]))[0], expected / np.linalg.norm(expected), atol=1e-5
    )


def test_a_saved_head_loads_with_its_content_fingerprint(tmp_path):
    path = tmp_path / "head.safetensors"
    sha = save_query_head(path, _tensors(), {"trained_on": "test"})
    head = load_query_head(path, dim=8)
    assert head.fingerprint == sha[:16]
    np.testing.assert_array_equal(head.l1_weight, _tensors()["l1.weight"])
    assert save_query_head(tmp_path / "again.safetensors", _tensors(), {"trained_on": "test"}) == sha
    assert save_query_head(tmp_path / "other.safetensors", _tensors(seed=3), {"trained_on": "test"}) != sha


def _write(path: Path, tensors: dict, metadata: dict) -> Path:
    from safetensors.numpy import save_file

    save_file(tensors, str(path), metadata=metadata)
    return path


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t, m: m.update(format="other/1"), "format must be 'kvmem-query-head/1', got 'other/1'"),
        (lambda t, m: t.pop("l2.bias"), "tensors must be exactly"),
        (lambda t, m: t.update({"extra": np.zeros(1, np.float32)}), "tensors must be exactly"),
        (
            lambda t, m: t.update({"l1.bias": np.zeros(5, np.float32)}),
            "l1.bias must be float32 of shape (4,)",
        ),
        (
            lambda t, m: t.update({"l1.weight": np.zeros((4, 9), np.float32)}),
            "l1.weight must be float32 of shape (4, 8)",
        ),
        (lambda t, m: t.update({"l2.bias": np.zeros(1, np.float64)}), "l2.bias must be float32"),
        (
            lambda t, m: t["l2.weight"].__setitem__((0, 0), np.inf),
            "l2.weight holds a value that is not finite",
        ),
    ],
)
def test_bad_heads_are_refused_with_the_reason(tmp_path, edit, message):
    tensors, metadata = _tensors(), {"format": "kvmem-query-head/1"}
    edit(tensors, metadata)
    path = _write(tmp_path / "bad.safetensors", tensors, metadata)
    with pytest.raises(QueryHeadLoadError, match=str(path).replace(".", r"\.")) as info:
        load_query_head(path, dim=8)
    assert message in str(info.value)


def test_missing_corrupt_and_substituted_heads_are_refused(tmp_path, monkeypatch):
    with pytest.raises(QueryHeadLoadError, match="query head cannot be read"):
        load_query_head(tmp_path / "none.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"\x00" * 20)
    with pytest.raises(QueryHeadLoadError, match="not a safetensors file"):
        load_query_head(tmp_path / "junk.safetensors")
    other = tmp_path / "other.safetensors"
    save_query_head(other, _tensors(dim=384), {})
    monkeypatch.setattr(query_head_module, "DEFAULT_HEAD", other)  # another file under the shipped name
    with pytest.raises(QueryHeadLoadError, match=f"is not the shipped head's {DEFAULT_HEAD_SHA256}"):
        load_query_head()


def test_the_shipped_head_is_the_pinned_one_and_reproduces_its_training_probes():
    head = load_query_head()
    assert head.fingerprint == DEFAULT_HEAD_SHA256[:16]
    assert head.l1_weight.shape == (16, 384)
    result = json.loads(RESULTS.read_text())
    assert result["head"]["sha256"] == DEFAULT_HEAD_SHA256
    embedder = default_embedder()
    assert embedder.query_name == f"all-MiniLM-L6-v2-onnx-int8+qh-{DEFAULT_HEAD_SHA256[:16]}"
    texts = list(result["probes"])
    memory, query = embedder.embed_for_search(texts)
    np.testing.assert_allclose(query, np.array([result["probes"][t] for t in texts]), atol=2e-5)
    np.testing.assert_array_equal(memory, embedder.embed(texts))  # the memory vectors are embed's
    assert (query * memory).sum(axis=1).max() < 0.99  # the head moved every probe


def test_the_plain_embedder_pools_queries_as_memories():
    plain = load_embedder("minilm-onnx-plain")
    assert plain.query_head is None and plain.query_name == plain.name == default_embedder().name
    memory, query = plain.embed_for_search(["What is my dog's name?"])
    np.testing.assert_array_equal(memory, query)


def test_search_ranks_by_the_query_vector_and_stores_memory_vectors(tmp_path):
    embedder = default_embedder()
    texts = ["I adopted a beagle named Max last weekend.", "The quarterly tax filing is due on Friday."]
    question = "What is my dog's name?"
    with MemoryStore(tmp_path / "s.db", embedder=embedder) as store:
        added = store.add("u", messages=[{"role": "user", "content": t} for t in texts])
        hits = store.search("u", question, top_k=2, mode="dense")
        # the question is searched first, then stored: it is stored with its memory vector, not the query's
        store.add("u", messages=[{"role": "user", "content": question}])
        stored = {
            r[0]: np.frombuffer(r[1], dtype=np.float32)
            for r in store._conn().execute(
                "SELECT m.text, v.vec FROM memory_vectors v JOIN memories m ON m.rowid = v.rowid"
            )
        }
    memory, query = embedder.embed_for_search([question])
    expected = {m.id: float(embedder.embed([m.text])[0] @ query[0]) for m in added}
    assert [h.memory.id for h in hits] == sorted(expected, key=lambda i: -expected[i])
    for hit in hits:
        assert hit.score == pytest.approx(expected[hit.memory.id], abs=1e-5)
    np.testing.assert_array_equal(stored[question], memory[0])
    assert not np.allclose(stored[question], query[0], atol=1e-3)

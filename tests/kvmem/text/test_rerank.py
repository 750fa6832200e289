"""Hybrid search's second stage: exact reordering, weights refused at load, fallback, speaker from metadata."""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from kvmem.text import HashEmbedder, MemoryStore, TextStoreConfig
from kvmem.text.search.rerank import (
    DEFAULT_WEIGHTS,
    LearnedReranker,
    RerankerLoadError,
    RerankerUnavailable,
    apply_scores,
    content_sha256,
    load_weights,
    write_weights,
)
from kvmem.text.search.rerank_features import FEATURE_SET, FEATURES, NUM_FEATURES, speaker_of
from kvmem.text.search.rerank_llm import parse_grades

COL = {name: i for i, name in enumerate(FEATURES)}


def linear_weights(tmp_path, weights: dict[str, float], name: str = "w.json"):
    """A linear weights file scoring sum(w * x) over the named features (mean 0, scale 1)."""
    params = {
        "mean": [0.0] * NUM_FEATURES,
        "scale": [1.0] * NUM_FEATURES,
        "weights": [float(weights.get(f, 0.0)) for f in FEATURES],
        "bias": 0.0,
    }
    path = tmp_path / name
    write_weights(path, "linear", params, {"test": True})
    return path


def stump_weights(tmp_path, feature: str, left: float, right: float, threshold: float = 0.5):
    path = tmp_path / "stumps.json"
    write_weights(path, "stumps", {"base": 0.0, "stumps": [[COL[feature], threshold, left, right]]}, {})
    return path


def test_apply_scores_reorders_a_known_top_50_deterministically():
    ranked = [(1000 + i, 1.0 - i / 100) for i in range(60)]  # first stage: rowid 1000 best
    scores = np.array([(i * 7) % 50 / 50 for i in range(50)])  # a permutation of 0 .. 0.98 by 0.02
    scores[3] = scores[10]  # a tie: 3 before 10, as the first stage had them
    out = apply_scores(ranked, scores)
    head = sorted(range(50), key=lambda i: (-scores[i], i))
    assert [r for r, _ in out[:50]] == [1000 + i for i in head]
    assert [r for r, _ in out[50:]] == [1050 + i for i in range(10)]  # beyond the depth: first-stage order
    assert [s for _, s in out] == sorted((s for _, s in out), reverse=True)  # scores descend
    assert out == apply_scores(ranked, scores.copy())


def test_linear_and_stump_models_score_exactly(tmp_path):
    features = np.zeros((3, NUM_FEATURES))
    features[:, COL["dense_cos"]] = [0.1, 0.5, 0.3]
    features[:, COL["is_question"]] = [0, 1, 0]
    linear = load_weights(linear_weights(tmp_path, {"dense_cos": 2.0, "is_question": -1.0}))
    z = np.array([0.2, 0.0, 0.6])
    assert np.allclose(linear.score("q", ["a", "b", "c"], features), 1 / (1 + np.exp(-z)))
    stumps = load_weights(stump_weights(tmp_path, "is_question", left=-1.0, right=2.0))
    assert np.allclose(
        stumps.score("q", ["a", "b", "c"], features), 1 / (1 + np.exp(-np.array([-1.0, 2.0, -1.0])))
    )


def test_shipped_weights_load_for_this_feature_set():
    document = json.loads(DEFAULT_WEIGHTS.read_text())
    assert document["feature_set"] == FEATURE_SET and document["features"] == list(FEATURES)
    assert isinstance(load_weights(), LearnedReranker)


def _edited(tmp_path, edit, resign: bool = True):
    path = linear_weights(tmp_path, {"dense_cos": 1.0})
    document = json.loads(path.read_text())
    edit(document)
    if resign:
        document["sha256"] = content_sha256(document)
    path.write_text(json.dumps(document))
    return path


@pytest.mark.parametrize(
    ("edit", "resign", "message"),
    [
        (lambda d: d.update(feature_set="kvmem-ltr-v0"), True, "feature set 'kvmem-ltr-v0'"),
        (lambda d: d["features"].reverse(), True, "other columns"),
        (lambda d: d.update(format="other/9"), True, "format must be"),
        (lambda d: d["params"]["weights"].pop(), True, "params.weights must be a list of 19 numbers"),
        (lambda d: d["params"].update(bias="x"), True, "params.bias"),
        (lambda d: d["params"]["scale"].__setitem__(0, 0.0), True, "params.scale must be > 0"),
        (lambda d: d.update(model="forest"), True, "model must be 'linear' or 'stumps'"),
        (lambda d: d["params"]["weights"].__setitem__(0, 5.0), False, "sha256 does not match"),
    ],
)
def test_bad_weights_are_refused_at_load_with_the_reason(tmp_path, edit, resign, message):
    path = _edited(tmp_path, edit, resign)
    with pytest.raises(RerankerLoadError, match=message) as info:
        load_weights(path)
    assert str(path) in str(info.value)


def test_missing_and_corrupt_weights_are_refused(tmp_path):
    with pytest.raises(RerankerLoadError, match="cannot be read"):
        load_weights(tmp_path / "absent.json")
    (tmp_path / "bad.json").write_text('{"format": "kvmem-rerank/1", ')
    with pytest.raises(RerankerLoadError, match="not valid JSON"):
        load_weights(tmp_path / "bad.json")
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(RerankerLoadError, match="JSON object"):
        load_weights(tmp_path / "list.json")


TURNS = [
    {"role": "Emi", "content": "I adopted a beagle puppy last week"},
    {"role": "Paola", "content": "A beagle! What is the puppy called?"},
    {"role": "Emi", "content": "Her name is Biscuit, she loves the beach"},
    {"role": "Paola", "content": "Do you take the beagle to the beach often?"},
]
QUERY = "What is the name of Emi's beagle puppy?"


def _store(new_location, clock, name="m.db", **config):
    store = MemoryStore(
        new_location(name), embedder=HashEmbedder(), config=TextStoreConfig(**config), clock=clock
    )
    store.add("u", messages=TURNS, session_id="s")
    return store


def _order(store, **kw):
    return [h.memory.text for h in store.search("u", QUERY, **kw)]


def test_a_bad_weights_file_is_logged_at_open_and_search_keeps_the_first_stage(
    tmp_path, new_location, clock, caplog
):
    first = _order(_store(new_location, clock, "a.db", rerank="none"))
    (tmp_path / "bad.json").write_text("not json")
    with caplog.at_level(logging.ERROR, logger="kvmem.text.store"):
        store = _store(new_location, clock, "b.db", rerank_weights=str(tmp_path / "bad.json"))
    assert any(
        "reranker 'ltr' refused" in r.message and "not valid JSON" in r.message for r in caplog.records
    )
    assert _order(store) == first
    store.close()


def test_the_reranked_order_is_what_search_returns(tmp_path, new_location, clock):
    first = _order(_store(new_location, clock, "a.db", rerank="none"))
    # questions first, then the first stage's order (ties keep it)
    questions_first = [t for t in first if t.endswith("?")] + [t for t in first if not t.endswith("?")]
    assert questions_first != first
    store = _store(
        new_location, clock, "b.db", rerank_weights=str(stump_weights(tmp_path, "is_question", -3.0, 3.0))
    )
    assert _order(store) == questions_first
    hits = store.search("u", QUERY, top_k=2)
    assert [h.memory.text for h in hits] == questions_first[:2]
    assert hits[0].score == pytest.approx(1 / (1 + np.exp(-3.0)))
    assert _order(store, mode="keyword") == _order(
        _store(new_location, clock, "c.db", rerank="none"), mode="keyword"
    )
    store.close()


def test_an_unavailable_reranker_keeps_the_first_stage_with_a_log_line(tmp_path, new_location, clock, caplog):
    first = _order(_store(new_location, clock, "a.db", rerank="none"))
    store = _store(new_location, clock, "b.db")

    class Down:
        name = "down"

        def score(self, query, texts, features):
            raise RerankerUnavailable("connection refused")

    store._rerankers = {k: Down() for k in store._rerankers}
    with caplog.at_level(logging.WARNING, logger="kvmem.text.search.rerank_stage"):
        assert _order(store) == first
    assert any("reranker down unavailable (connection refused)" in r.message for r in caplog.records)
    store.close()


def test_speaker_is_read_from_metadata_then_role():
    assert speaker_of("user", {"speaker": "Emi Tanaka"}) == "emi"
    assert speaker_of("Paola", {}) == "paola"
    assert speaker_of("Paola", {"speaker": 3}) == "paola"  # not a string: the role
    assert speaker_of(None, None) == ""


def test_speaker_match_feature_reads_metadata_on_imported_turns(store_location, clock):
    store = MemoryStore(store_location, embedder=HashEmbedder(), clock=clock)
    for turn in TURNS:  # a multi-party log imported as role 'user', the speaker in metadata
        store.add(
            "u",
            messages=[{"role": "user", "content": turn["content"]}],
            session_id="s",
            metadata={"speaker": turn["role"]},
        )
    candidates = store.search_candidates("u", QUERY)
    by_text = dict(zip(candidates.texts, candidates.features[:, COL["speaker_match"]].tolist(), strict=True))
    assert by_text == {t["content"]: float(t["role"] == "Emi") for t in TURNS if t["content"] in by_text}
    assert by_text[TURNS[0]["content"]] == 1.0
    store._vectors.clear()  # the same speakers when the per-user rows are read back from the file
    again = store.search_candidates("u", QUERY)
    assert np.array_equal(again.features, candidates.features)
    store.close()


def test_llm_judge_grades_are_parsed_strictly():
    assert parse_grades('sure: {"grades": [3, 10, 12]}', 3).tolist() == [3.0, 10.0, 10.0]
    with pytest.raises(ValueError, match="expected 2 grades"):
        parse_grades('{"grades": [1]}', 2)


def test_config_refuses_an_unknown_reranker():
    with pytest.raises(ValueError, match="TextStoreConfig.rerank must be one of"):
        TextStoreConfig(rerank="bm25")
    with pytest.raises(ValueError, match="rerank_depth"):
        TextStoreConfig(rerank_depth=0)


class _Judge(BaseHTTPRequestHandler):
    """An OpenAI-compatible chat endpoint serving 'judge-model' that grades each numbered memory by whether it
    holds 'Biscuit'; like kvmem serve, it refuses a request for another model (an empty name included)."""

    def do_GET(self):  # noqa: N802 (http.server's name)
        self._send(200, {"object": "list", "data": [{"id": "judge-model", "object": "model"}]})

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if body["model"] != "judge-model":
            self._send(404, {"error": {"code": "model_not_found"}})
            return
        lines = [ln for ln in body["messages"][1]["content"].splitlines() if ln[:1].isdigit()]
        grades = [10 if "Biscuit" in ln else 1 for ln in lines]
        self._send(200, {"choices": [{"message": {"content": json.dumps({"grades": grades})}}]})

    def _send(self, status: int, reply: dict) -> None:
        data = json.dumps(reply).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_llm_judge_orders_by_its_grades_and_falls_back_when_down(tmp_path, new_location, clock, caplog):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Judge)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/v1"
        # no model named: the judge asks the endpoint which it serves
        store = _store(new_location, clock, "a.db", rerank="llm", rerank_llm_url=url)
        hits = store.search("u", QUERY)
        assert hits[0].memory.text == TURNS[2]["content"] and hits[0].score == 1.0
        first = _order(_store(new_location, clock, "b.db", rerank="none"))
        assert [h.memory.text for h in hits[1:]] == [t for t in first if t != TURNS[2]["content"]]
    finally:
        server.shutdown()
        server.server_close()
    with caplog.at_level(logging.WARNING, logger="kvmem.text.search.rerank_stage"):
        assert _order(store) == first  # the endpoint is gone: the first stage's order
    assert any("reranker llm unavailable" in r.message for r in caplog.records)
    store.close()

"""rerank_train's models on made-up candidates: each learns a separating feature, cross-validation is by chat,
and what it writes loads back as the store's reranker with the same scores."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.memory.rerank_train import (
    MODELS,
    Query,
    cross_validate,
    evaluate,
    fit_logistic,
    order_by,
    score_with,
)
from kvmem.text.search.rerank import load_weights, write_weights
from kvmem.text.search.rerank_features import FEATURES, NUM_FEATURES

COL = {name: i for i, name in enumerate(FEATURES)}


def _queries(num: int = 24, seed: int = 0) -> list[Query]:
    """Candidates whose evidence is exactly the rows with is_question 0 and log_length above 0.5; the first
    stage ranks the evidence last."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(num):
        x = rng.uniform(0, 1, size=(20, NUM_FEATURES))
        x[:, COL["is_question"]] = rng.integers(0, 2, size=20)
        labels = ((x[:, COL["is_question"]] == 0) & (x[:, COL["log_length"]] > 0.5)).astype(np.float64)
        order = np.argsort(labels, kind="stable")  # evidence last in the first stage
        out.append(Query(f"chat{i % 3}", "1", x[order], labels[order], max(int(labels.sum()), 1)))
    return out


def test_every_model_learns_the_separating_features():
    queries = _queries()
    first = evaluate(queries, lambda q: np.arange(q.labels.shape[0]))
    for name in ("logistic", "pairwise", "stumps"):
        fitted = MODELS[name](queries)
        result = evaluate(queries, lambda q, f=fitted: order_by(score_with(f, q.features)))
        assert result["recall@10"] > first["recall@10"] + 0.3, name


def test_excluded_and_fixed_weights_stay_as_set():
    fitted = fit_logistic(_queries(), exclude=("dense_cos",), fixed={"speaker_match": 0.25})
    params = fitted["params"]
    assert params["weights"][COL["dense_cos"]] == 0.0
    assert params["weights"][COL["speaker_match"]] == 0.25
    assert (params["mean"][COL["speaker_match"]], params["scale"][COL["speaker_match"]]) == (0.0, 1.0)


def test_cross_validation_scores_each_chat_with_a_model_fitted_without_it():
    queries = _queries()
    seen: list[set[str]] = []

    def fit(train):
        seen.append({q.group for q in train})
        return fit_logistic(train)

    result = cross_validate(queries, fit)
    assert sorted(map(sorted, seen)) == [["chat0", "chat1"], ["chat0", "chat2"], ["chat1", "chat2"]]
    assert result["num_questions"] == len(queries)


@pytest.mark.parametrize("name", ["logistic", "stumps"])
def test_written_weights_load_as_the_stores_reranker_with_the_same_order(tmp_path, name):
    queries = _queries()
    fitted = MODELS[name](queries)
    write_weights(tmp_path / "w.json", fitted["model"], fitted["params"], {"test": True})
    reranker = load_weights(tmp_path / "w.json")
    for q in queries[:5]:
        served = reranker.score("q", [""] * q.labels.shape[0], q.features)
        assert np.array_equal(order_by(served), order_by(score_with(fitted, q.features)))

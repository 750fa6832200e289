"""The second stage of hybrid search: reorders the first stage's top candidates.

Owns the `Reranker` interface, the learning-to-rank models shipped as JSON weights (a linear model and boosted
stumps, both fitted on the tune split of real dialogue by benchmarks/memory/rerank_train.py), how a weights file is
checked at load (format, feature set and its columns, sha256 of the content, finite numbers: anything else is
refused with a RerankerLoadError naming the file and the reason), the registry of rerankers by name and how
scores become the final order. No pickle: weights are JSON. Knows nothing of SQL or of how features are made
(rerank_features.py); the LLM judge lives in rerank_llm.py.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from kvmem.text.errors import RerankerLoadError
from kvmem.text.errors import RerankerUnavailable as RerankerUnavailable  # lives in errors.py; re-exported
from kvmem.text.search.rerank_features import FEATURE_SET, FEATURES, NUM_FEATURES
from kvmem.text.search.rerank_llm import LLMJudge

WEIGHTS_FORMAT = "kvmem-rerank/1"
DEFAULT_WEIGHTS = Path(__file__).with_name("rerank_weights.json")
RERANKERS = ("none", "ltr", "llm")


class Reranker(Protocol):
    """Scores a query's first-stage candidates; higher is better. Pure: no state changes, no I/O (except the
    LLM judge, which asks its endpoint). `features` is [n, NUM_FEATURES] in FEATURES order; returns [n]
    scores in [0, 1]."""

    name: str

    def score(self, query: str, texts: list[str], features: np.ndarray) -> np.ndarray: ...


@dataclass(frozen=True)
class LinearModel:
    """z = sum(weights * (x - mean) / scale) + bias."""

    mean: np.ndarray  # [F]
    scale: np.ndarray  # [F]
    weights: np.ndarray  # [F]
    bias: float

    def raw(self, features: np.ndarray) -> np.ndarray:
        return ((features - self.mean) / self.scale) @ self.weights + self.bias


@dataclass(frozen=True)
class StumpsModel:
    """z = base + sum over stumps of (left if x[feature] <= threshold else right)."""

    base: float
    feature: np.ndarray  # [S] int
    threshold: np.ndarray  # [S]
    left: np.ndarray  # [S]
    right: np.ndarray  # [S]

    def raw(self, features: np.ndarray) -> np.ndarray:
        if self.feature.shape[0] == 0:
            return np.full(features.shape[0], self.base)
        below = features[:, self.feature] <= self.threshold  # [n, S]
        return self.base + np.where(below, self.left, self.right).sum(axis=1)


def content_sha256(document: dict) -> str:
    """sha256 of a weights document without its `sha256` key, as canonical JSON (sorted keys, no spaces)."""
    body = {k: v for k, v in document.items() if k != "sha256"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


class LearnedReranker:
    """A learning-to-rank model over the first stage's features; score = sigmoid(model(features))."""

    name = "ltr"

    def __init__(self, model: LinearModel | StumpsModel, source: str = "") -> None:
        self.model = model
        self.source = source

    def score(self, query: str, texts: list[str], features: np.ndarray) -> np.ndarray:
        assert features.shape[1] == NUM_FEATURES, features.shape
        z = np.clip(self.model.raw(features), -30.0, 30.0)
        return 1.0 / (1.0 + np.exp(-z))


def _floats(params: dict, key: str, size: int | None, where: str) -> np.ndarray:
    value = params.get(key)
    if not isinstance(value, list) or (size is not None and len(value) != size):
        raise RerankerLoadError(f"{where}: params.{key} must be a list of {size or 'some'} numbers")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value):
        raise RerankerLoadError(f"{where}: params.{key} must hold finite numbers only")
    return np.array(value, dtype=np.float64)


def parse_weights(document: object, where: str = "weights") -> LearnedReranker:
    """The reranker a weights document describes; RerankerLoadError (naming `where`) if it is not exactly a
    document of this format, for this feature set, with its sha256 intact."""
    if not isinstance(document, dict):
        raise RerankerLoadError(
            f"{where}: a weights document is a JSON object, got {type(document).__name__}"
        )
    if document.get("format") != WEIGHTS_FORMAT:
        raise RerankerLoadError(f"{where}: format must be {WEIGHTS_FORMAT!r}, got {document.get('format')!r}")
    if document.get("feature_set") != FEATURE_SET or document.get("features") != list(FEATURES):
        raise RerankerLoadError(
            f"{where}: fitted on feature set {document.get('feature_set')!r} with other columns; this "
            f"code computes {FEATURE_SET!r} {list(FEATURES)}: refit it (benchmarks/memory/rerank_train.py)"
        )
    if document.get("sha256") != content_sha256(document):
        raise RerankerLoadError(f"{where}: sha256 does not match the content (corrupt or edited by hand)")
    params = document.get("params")
    if not isinstance(params, dict):
        raise RerankerLoadError(f"{where}: params must be an object")
    kind = document.get("model")
    if kind == "linear":
        scale = _floats(params, "scale", NUM_FEATURES, where)
        if (scale <= 0).any():
            raise RerankerLoadError(f"{where}: params.scale must be > 0")
        bias = _floats({"bias": [params.get("bias")]}, "bias", 1, where)[0]
        model: LinearModel | StumpsModel = LinearModel(
            _floats(params, "mean", NUM_FEATURES, where),
            scale,
            _floats(params, "weights", NUM_FEATURES, where),
            bias,
        )
    elif kind == "stumps":
        stumps = params.get("stumps")
        if not isinstance(stumps, list) or not all(isinstance(s, list) and len(s) == 4 for s in stumps):
            raise RerankerLoadError(
                f"{where}: params.stumps must be a list of [feature, threshold, left, right]"
            )
        table = _floats({"v": [v for s in stumps for v in s]}, "v", 4 * len(stumps), where).reshape(-1, 4)
        feature = table[:, 0].astype(np.int64)
        if ((feature < 0) | (feature >= NUM_FEATURES) | (feature != table[:, 0])).any():
            raise RerankerLoadError(f"{where}: a stump's feature must be an index below {NUM_FEATURES}")
        base = _floats({"base": [params.get("base")]}, "base", 1, where)[0]
        model = StumpsModel(base, feature, table[:, 1], table[:, 2], table[:, 3])
    else:
        raise RerankerLoadError(f"{where}: model must be 'linear' or 'stumps', got {kind!r}")
    return LearnedReranker(model, where)


def load_weights(path: str | Path | None = None) -> LearnedReranker:
    """The learned reranker in the JSON weights file `path` (None: the one shipped with the package)."""
    path = Path(path) if path is not None else DEFAULT_WEIGHTS
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise RerankerLoadError(f"{path}: reranker weights cannot be read ({exc.strerror or exc})") from exc
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RerankerLoadError(f"{path}: reranker weights are not valid JSON ({exc})") from exc
    return parse_weights(document, str(path))


def write_weights(path: str | Path, model: str, params: dict, trained_on: dict) -> dict:
    """Writes a weights document (sha256 filled in) to a temporary name and renames it into place."""
    document = {
        "format": WEIGHTS_FORMAT,
        "model": model,
        "feature_set": FEATURE_SET,
        "features": list(FEATURES),
        "params": params,
        "trained_on": trained_on,
    }
    document["sha256"] = content_sha256(document)
    parse_weights(document, str(path))  # what is written must load
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(document, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    tmp.replace(path)
    return document


def build_reranker(
    name: str, weights: str | None = None, llm_url: str | None = None, llm_model: str = ""
) -> Reranker | None:
    """The reranker `name` names (None for 'none'); RerankerLoadError when it cannot be built."""
    if name == "none":
        return None
    if name == "ltr":
        return load_weights(weights)
    if name == "llm":
        if not llm_url:
            raise RerankerLoadError("the 'llm' reranker needs rerank_llm_url (an OpenAI-compatible base URL)")
        return LLMJudge(llm_url, llm_model)
    raise RerankerLoadError(f"unknown reranker {name!r}; supported: {list(RERANKERS)}")


def apply_scores(ranked: list[tuple[int, float]], scores: np.ndarray) -> list[tuple[int, float]]:
    """The first len(scores) of `ranked` reordered by `scores` (best first; ties keep the first-stage order),
    then the rest in first-stage order with scores capped below the lowest reranked one, so scores descend."""
    n = scores.shape[0]
    assert n <= len(ranked), (n, len(ranked))
    order = np.lexsort((np.arange(n), -scores))
    head = [(ranked[i][0], float(scores[i])) for i in order.tolist()]
    floor = float(scores.min()) if n else 1.0
    tail = [(r, min(s, floor)) for r, s in ranked[n:]]
    return head + tail

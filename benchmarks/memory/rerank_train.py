"""Fits and chooses hybrid search's second stage (learning to rank over the first stage's top candidates).

Run: python -m benchmarks.memory.rerank_train --split tune --vector-cache V.npz \
        --weights-out kvmem/text/search/rerank_weights.json --out benchmarks/results/cpu/recall_bench/rerank_train_tune.json
Loads the split as benchmarks.memory.recall_bench does (one user per chat, one memory per turn), then for every
question with evidence takes the first stage's top rerank_depth (100) with their features
(MemoryStore.search_candidates, the code search runs) and labels a candidate 1 when it is an evidence turn.
Candidate models, each scored by leave-one-chat-out cross-validation on the split (fit on the other chats,
reorder this chat's candidates, recall@10 over all its evidence, so evidence outside the candidates counts as
missed): the first stage's own order, a pointwise logistic regression (also with the speaker features left out
or held at a fixed weight), a pairwise linear model (RankNet loss) and boosted stumps (logistic loss); any of
them may also be trained on the wrong-name questions (`<model>+wrong_name`).
Each is also scored on the speaker probe (questions naming one of the two speakers, as written and with the
other's name: recall_bench.speaker_probe); a model may not lower the wrong-name recall@10 more than
WRONG_NAME_SLACK below the first stage's. Of those, the best cross-validated recall@10 is refitted on the whole split and written as JSON weights
(kvmem.text.search.rerank.write_weights; no pickle). Only numpy. The last stdout line is one JSON document.
"""

from __future__ import annotations

import argparse
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.common import git_sha, write_outputs
from benchmarks.memory.conversations import load_split
from benchmarks.memory.recall_bench import (
    DEFAULT_DATA_DIR,
    CachedEmbedder,
    load_conversations,
    parse_overrides,
)
from kvmem.text import MemoryStore, TextStoreConfig, load_embedder
from kvmem.text.search.rerank import write_weights
from kvmem.text.search.rerank_features import FEATURE_SET, FEATURES

SEED = 0
# a model may not lower R@10 on questions naming the wrong speaker by more than this below the first stage's
WRONG_NAME_SLACK = 0.02
TOP_K = 10


@dataclass(frozen=True)
class Query:
    """One question's candidates: features [n, F], labels [n] (1: evidence), how much evidence it has."""

    group: str  # the chat it belongs to (the cross-validation fold)
    category: str
    features: np.ndarray
    labels: np.ndarray
    num_evidence: int


def collect(store: MemoryStore, conversations, ids, probe: str | None = None) -> list[Query]:
    """The second stage's input for every question with evidence (first stage as the store's config sets).

    probe 'named' / 'wrong_name': only the questions naming exactly one of the chat's two speakers, as
    written / with the other speaker's name (recall_bench.speaker_probe), scored against the same evidence."""
    queries = []
    for conversation in conversations:
        user_id = f"realtalk/{conversation.name}"
        speakers = sorted({t.speaker for s in conversation.sessions for t in s.turns})
        for question in conversation.questions:
            if not question.evidence:
                continue
            text = question.text
            if probe is not None:
                words = {w.lower() for w in re.findall(r"\w+", text)}
                hit = [s for s in speakers if s.lower() in words]
                if len(speakers) != 2 or len(hit) != 1:
                    continue
                if probe == "wrong_name":
                    other = speakers[1 - speakers.index(hit[0])]
                    text = re.sub(rf"\b{re.escape(hit[0])}\b", other, text, flags=re.IGNORECASE)
            wanted = {ids[user_id][e] for e in question.evidence}
            candidates = store.search_candidates(user_id, text)
            if candidates is None:
                continue
            labels = np.array([m in wanted for m in candidates.memory_ids], dtype=np.float64)
            queries.append(
                Query(conversation.name, question.category, candidates.features, labels, len(wanted))
            )
    return queries


def recall_at(order: np.ndarray, query: Query, k: int) -> float:
    return float(query.labels[order[:k]].sum()) / query.num_evidence


def reciprocal_rank(order: np.ndarray, query: Query, k: int = TOP_K) -> float:
    hits = np.flatnonzero(query.labels[order[:k]])
    return 1.0 / (hits[0] + 1) if hits.shape[0] else 0.0


def order_by(scores: np.ndarray) -> np.ndarray:
    """Best first; ties keep the first stage's order (as kvmem.text.search.rerank.apply_scores)."""
    return np.lexsort((np.arange(scores.shape[0]), -scores))


# ----------------------------------------------------------------- models (each: fit -> (kind, params, score fn))


def standardize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    mean = x.mean(axis=0)
    scale = x.std(axis=0)
    return mean, np.where(scale > 1e-9, scale, 1.0)


def fit_logistic(
    queries: list[Query],
    l2: float = 1.0,
    steps: int = 300,
    exclude: tuple[str, ...] = (),
    fixed: dict[str, float] | None = None,
) -> dict:
    """Pointwise logistic regression on standardized features, by Newton's method (L2 on the weights).
    `exclude`d features keep weight 0; `fixed` ones keep the given weight (on the raw feature), not fitted."""
    fixed = fixed or {}
    x = np.concatenate([q.features for q in queries])
    y = np.concatenate([q.labels for q in queries])
    mean, scale = standardize(x)
    frozen = [FEATURES.index(name) for name in (*exclude, *fixed)]
    mean[frozen], scale[frozen] = 0.0, 1.0
    offset = sum(x[:, FEATURES.index(name)] * w for name, w in fixed.items()) if fixed else 0.0
    z = np.hstack([(x - mean) / scale, np.ones((x.shape[0], 1))])  # [N, F+1]
    z[:, frozen] = 0.0
    w = np.zeros(z.shape[1])
    reg = np.full(z.shape[1], l2)
    reg[-1] = 0.0
    for _ in range(steps):
        p = 1 / (1 + np.exp(-np.clip(z @ w + offset, -30, 30)))
        grad = z.T @ (p - y) + reg * w
        hess = (z * (p * (1 - p))[:, None]).T @ z + np.diag(reg + 1e-9)
        step = np.linalg.solve(hess, grad)
        w -= step
        if np.abs(step).max() < 1e-8:
            break
    weights = w[:-1]
    for name, value in fixed.items():
        weights[FEATURES.index(name)] = value
    return linear_params(mean, scale, weights, float(w[-1]))


def fit_pairwise(queries: list[Query], l2: float = 1.0, steps: int = 400, lr: float = 0.5) -> dict:
    """Pairwise linear model: logistic loss on (evidence, non-evidence) differences within each question."""
    x = np.concatenate([q.features for q in queries])
    mean, scale = standardize(x)
    diffs = []
    for q in queries:
        pos, neg = np.flatnonzero(q.labels > 0), np.flatnonzero(q.labels == 0)
        if pos.shape[0] and neg.shape[0]:
            f = (q.features - mean) / scale
            d = (f[pos][:, None, :] - f[neg][None, :, :]).reshape(-1, f.shape[1])
            diffs.append(d / max(d.shape[0], 1) ** 0.5)  # each question weighs about the same
    d = np.concatenate(diffs)  # [pairs, F]
    w = np.zeros(d.shape[1])
    for _ in range(steps):
        p = 1 / (1 + np.exp(-np.clip(d @ w, -30, 30)))
        grad = -(d.T @ (1 - p)) / len(queries) + l2 * w / len(queries)
        w -= lr * grad
    # the bias of a ranking model is free; set it so the mean candidate scores 0.5 in sigmoid space
    return linear_params(mean, scale, w, 0.0)


def fit_stumps(queries: list[Query], rounds: int = 150, lr: float = 0.1, num_thresholds: int = 16) -> dict:
    """Gradient-boosted stumps (depth 1) with logistic loss: each round the split and leaf values that best fit
    the negative gradient (Newton leaf values)."""
    x = np.concatenate([q.features for q in queries])
    y = np.concatenate([q.labels for q in queries])
    base = float(np.log(max(y.mean(), 1e-6) / max(1 - y.mean(), 1e-6)))
    f = np.full(x.shape[0], base)
    grid = [
        np.unique(np.quantile(x[:, j], np.linspace(0.05, 0.95, num_thresholds))) for j in range(x.shape[1])
    ]
    stumps = []
    for _ in range(rounds):
        p = 1 / (1 + np.exp(-f))
        g, h = y - p, np.maximum(p * (1 - p), 1e-6)
        best = None
        for j, thresholds in enumerate(grid):
            for t in thresholds:
                left = x[:, j] <= t
                gl, hl = g[left].sum(), h[left].sum()
                gr, hr = g.sum() - gl, h.sum() - hl
                gain = gl * gl / (hl + 1.0) + gr * gr / (hr + 1.0)
                if best is None or gain > best[0]:
                    best = (gain, j, float(t), gl / (hl + 1.0), gr / (hr + 1.0))
        _, j, t, vl, vr = best
        stumps.append([j, t, lr * vl, lr * vr])
        f += np.where(x[:, j] <= t, lr * vl, lr * vr)
    return {"model": "stumps", "params": {"base": base, "stumps": stumps}}


def linear_params(mean, scale, weights, bias) -> dict:
    return {
        "model": "linear",
        "params": {
            "mean": [float(v) for v in mean],
            "scale": [float(v) for v in scale],
            "weights": [float(v) for v in weights],
            "bias": float(bias),
        },
    }


def score_with(fitted: dict, features: np.ndarray) -> np.ndarray:
    params = fitted["params"]
    if fitted["model"] == "linear":
        return ((features - params["mean"]) / np.array(params["scale"])) @ np.array(params["weights"])
    out = np.full(features.shape[0], params["base"])
    for j, t, left, right in params["stumps"]:
        out += np.where(features[:, int(j)] <= t, left, right)
    return out


SPEAKER_FEATURES = ("speaker_match", "speaker_other")
MODELS = {
    "logistic": fit_logistic,
    "logistic_no_speaker": lambda queries: fit_logistic(queries, exclude=SPEAKER_FEATURES),
    # the speaker's say held to a fixed weight (match +c, the other speaker named -c), the rest fitted
    **{
        f"logistic_speaker_{c}": (
            lambda queries, c=c: fit_logistic(queries, fixed={"speaker_match": c, "speaker_other": -c})
        )
        for c in (0.25, 0.5, 1.0)
    },
    "pairwise": fit_pairwise,
    "stumps": fit_stumps,
}


def evaluate(queries: list[Query], scorer) -> dict:
    """recall@5/@10 and MRR@10 over `queries`, overall and by category, with `scorer(query) -> order`."""
    rows = [
        (q.category, recall_at(o, q, 5), recall_at(o, q, 10), reciprocal_rank(o, q))
        for q in queries
        for o in [scorer(q)]
    ]

    def summary(subset):
        a = np.array([r[1:] for r in subset])
        return {
            "num_questions": len(subset),
            "recall@5": round(float(a[:, 0].mean()), 4),
            "recall@10": round(float(a[:, 1].mean()), 4),
            "mrr": round(float(a[:, 2].mean()), 4),
        }

    out = summary(rows)
    out["by_category"] = {c: summary([r for r in rows if r[0] == c]) for c in sorted({r[0] for r in rows})}
    return out


def cross_validate(
    queries: list[Query], fit, probes: dict[str, list[Query]] | None = None, extra: list[Query] | None = None
) -> dict:
    """Leave one chat out: fit on the others (with `extra` training questions of the other chats, if any),
    order this chat's candidates (and its probe questions')."""
    groups = sorted({q.group for q in queries})
    probes = probes or {}
    extra = extra or []
    fitted_by_group = {group: fit([q for q in [*queries, *extra] if q.group != group]) for group in groups}

    def scorer(q: Query) -> np.ndarray:
        return order_by(score_with(fitted_by_group[q.group], q.features))

    out = evaluate(queries, scorer)
    out["speaker_probe"] = {name: summary_only(evaluate(p, scorer)) for name, p in probes.items()}
    return out


def summary_only(result: dict) -> dict:
    return {k: v for k, v in result.items() if k != "by_category"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR)
    parser.add_argument("--split", default="tune", choices=("tune", "report", "all"))
    parser.add_argument("--embedder", default="default")
    parser.add_argument("--vector-cache", type=Path, default=None)
    parser.add_argument(
        "--set", action="append", default=[], metavar="FIELD=VALUE", help="first-stage config"
    )
    parser.add_argument(
        "--models",
        default=",".join(MODELS),
        help="comma-separated subset of " + ",".join(MODELS) + "; a name ending in +wrong_name is also "
        "trained on the wrong-name questions (the same evidence, the other speaker named)",
    )
    parser.add_argument("--weights-out", type=Path, default=None, help="write the winner's JSON weights here")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    np.random.seed(SEED)
    conversations = load_split(args.data_dir, args.split)
    embedder = CachedEmbedder(load_embedder(args.embedder), args.vector_cache)
    config = TextStoreConfig(**{**parse_overrides(args.set), "rerank": "none"})
    with tempfile.TemporaryDirectory(prefix="kvmem-rerank-train-") as tmp:
        with MemoryStore(Path(tmp) / "recall.db", embedder=embedder, config=config) as store:
            ids = load_conversations(store, conversations)
            embedder.save()
            queries = collect(store, conversations, ids)
            probes = {p: collect(store, conversations, ids, p) for p in ("named", "wrong_name")}
    first = lambda q: np.arange(q.labels.shape[0])  # noqa: E731
    results = {"first_stage": evaluate(queries, first)}
    results["first_stage"]["speaker_probe"] = {n: summary_only(evaluate(p, first)) for n, p in probes.items()}
    print(f"{'model':12s} {'R@5':>7s} {'R@10':>7s} {'MRR':>7s}  (leave-one-chat-out on {args.split})")
    print(
        f"{'first_stage':12s} {results['first_stage']['recall@5']:7.3f} {results['first_stage']['recall@10']:7.3f} {results['first_stage']['mrr']:7.3f}",
        flush=True,
    )
    for name in args.models.split(","):
        # "<model>+wrong_name": also trained on the wrong-name questions (the same evidence, the other
        # speaker named), so the model learns how far a named speaker can be trusted
        base, _, augment = name.partition("+")
        extra = probes["wrong_name"] if augment == "wrong_name" else None
        results[name] = cross_validate(queries, MODELS[base], probes, extra)
        r = results[name]
        print(
            f"{name:12s} {r['recall@5']:7.3f} {r['recall@10']:7.3f} {r['mrr']:7.3f}  named "
            f"{r['speaker_probe']['named']['recall@10']:.3f} wrong name {r['speaker_probe']['wrong_name']['recall@10']:.3f}",
            flush=True,
        )
    print(
        f"first stage speaker probe: named {results['first_stage']['speaker_probe']['named']['recall@10']:.3f} "
        f"wrong name {results['first_stage']['speaker_probe']['wrong_name']['recall@10']:.3f}"
    )
    floor = results["first_stage"]["speaker_probe"]["wrong_name"]["recall@10"] - WRONG_NAME_SLACK
    allowed = [
        m for m in args.models.split(",") if results[m]["speaker_probe"]["wrong_name"]["recall@10"] >= floor
    ]
    winner = max(allowed or ["first_stage"], key=lambda m: (results[m]["recall@10"], results[m]["mrr"]))
    result = {
        "benchmark": "kvmem.text second-stage selection (leave-one-chat-out)",
        "git_sha": git_sha(),
        "loadavg": [round(v, 2) for v in os.getloadavg()],
        "split": args.split,
        "feature_set": FEATURE_SET,
        "features": list(FEATURES),
        "num_queries": len(queries),
        "evidence_in_top_50": round(float(np.mean([q.labels.sum() / q.num_evidence for q in queries])), 4),
        "cross_validated": results,
        "wrong_name_floor": round(floor, 4),
        "winner": winner,
        "winner_margin_at_10": round(results[winner]["recall@10"] - results["first_stage"]["recall@10"], 4),
    }
    print(
        f"winner {winner}: R@10 {results[winner]['recall@10']:.3f} vs first stage {results['first_stage']['recall@10']:.3f}"
    )
    if args.weights_out is not None and winner != "first_stage":
        base, _, augment = winner.partition("+")
        fitted = MODELS[base]([*queries, *(probes["wrong_name"] if augment == "wrong_name" else [])])
        trained_on = {
            "dataset": "REALTALK",
            "split": args.split,
            "num_queries": len(queries),
            "selection": "leave-one-chat-out recall@10",
            "git_sha": git_sha(),
            "first_stage_overrides": parse_overrides(args.set),
            # the query vectors the dense features were computed with (the query head's fingerprint)
            "query_vectors": getattr(embedder._base, "query_name", embedder.name),
        }
        write_weights(args.weights_out, fitted["model"], fitted["params"], trained_on)
        result["weights"] = {"path": str(args.weights_out), "model": fitted["model"]}
    write_outputs(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

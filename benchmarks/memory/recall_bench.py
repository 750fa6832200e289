"""Retrieval recall on real multi-session conversations: recall@5/@10 and MRR per search mode and category.

Run: python -m benchmarks.memory.conversations                    # once: REALTALK into ~/.cache/kvmem/datasets/realtalk
     python -m benchmarks.memory.recall_bench --split report --vector-cache V.npz \
        --out benchmarks/results/cpu/recall_bench/recall_report_rerank.json
Each conversation is one user; each turn one memory, added session by session as chat messages (role = the
speaker's name, content = the text, chat_time = the message's time; with --speaker-in metadata, role 'user'
and the speaker in the memory's metadata, as an import of a multi-party log) through MemoryStore, the code the
memory routes call. Modes: keyword, dense, first_stage (hybrid without its second stage) and hybrid (the
store's default: first stage, then the reranker over its top candidates); plus a speaker probe (questions
naming one speaker, and the same questions naming the other one). Each question is searched as it is written (top_k 10, no filters) in every mode; a
question scores the share of its evidence turns in the top 5 / 10, and 1/rank of the first one (MRR@10).
Tunable values were picked on split 'tune' (odd chats) and are reported on 'report' (even chats). Prints a
table; the last stdout line is one JSON document (git sha included).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import re
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from benchmarks.common import git_sha, write_outputs
from benchmarks.memory.conversations import REALTALK_COMMIT, REALTALK_REPO, Conversation, load_split
from kvmem.text import Embedder, MemoryStore, TextStoreConfig, load_embedder

MODES = ("keyword", "dense", "first_stage", "hybrid")  # first_stage: hybrid without its second stage
KS = (5, 10)
DEFAULT_DATA_DIR = Path.home() / ".cache/kvmem/datasets/realtalk"


@dataclasses.dataclass(frozen=True)
class QuestionScore:
    recall: dict[int, float]  # k -> share of evidence in the top k
    reciprocal_rank: float  # 1 / rank of the first evidence turn in the top max(KS), else 0


def score_ranking(ranked: list[str], evidence: list[str], ks: tuple[int, ...] = KS) -> QuestionScore:
    """Scores one ranked list of turn ids against a question's evidence ids (at least one)."""
    assert evidence, "a question without evidence cannot be scored"
    wanted = set(evidence)
    recall = {k: len(wanted & set(ranked[:k])) / len(wanted) for k in ks}
    first = next((i for i, key in enumerate(ranked[: max(ks)], start=1) if key in wanted), None)
    return QuestionScore(recall, 1.0 / first if first else 0.0)


def summarize(scores: list[QuestionScore]) -> dict:
    """Means over questions: recall@k for each k and MRR, rounded to 4 places, with the count."""
    out: dict = {"num_questions": len(scores)}
    if not scores:
        return out
    for k in scores[0].recall:
        out[f"recall@{k}"] = round(float(np.mean([s.recall[k] for s in scores])), 4)
    out["mrr"] = round(float(np.mean([s.reciprocal_rank for s in scores])), 4)
    return out


class CachedEmbedder:
    """Wraps an embedder with a vector file keyed by text hash (npz, no pickle), so reruns skip embedding.

    Same `name` and `dim` as the wrapped embedder: its vectors are that embedder's, only remembered.
    """

    def __init__(self, base: Embedder, path: Path | None) -> None:
        self.name, self.dim, self._base, self._path = base.name, base.dim, base, path
        self._vectors: dict[str, np.ndarray] = {}
        if path is not None and path.exists():
            with np.load(path, allow_pickle=False) as data:
                self._vectors = dict(zip(data["keys"].tolist(), data["vectors"], strict=True))
        self._dirty = False

    @staticmethod
    def _key(text: str) -> str:
        return hashlib.sha1(text.encode("utf-8")).hexdigest()

    def embed(self, texts: list[str]) -> np.ndarray:
        keys = [self._key(t) for t in texts]
        missing = sorted({k: t for k, t in zip(keys, texts, strict=True) if k not in self._vectors}.items())
        if missing:
            vectors = self._base.embed([t for _, t in missing])
            self._vectors.update(zip([k for k, _ in missing], vectors, strict=True))
            self._dirty = True
        return np.stack([self._vectors[k] for k in keys]).astype(np.float32)  # [n, dim]

    def embed_for_search(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(memory vectors, query vectors) as the wrapped embedder's `embed_for_search` (its query head), the
        query vectors remembered under keys that hold the head's fingerprint (`query_name`), so a file made
        with one head never answers for another; an embedder without one: its memory vectors twice."""
        search = getattr(self._base, "embed_for_search", None)
        if search is None:
            vectors = self.embed(texts)
            return vectors, vectors
        tag = getattr(self._base, "query_name", self.name)
        query_keys = [self.query_key(tag, t) for t in texts]
        missing = [i for i, k in enumerate(query_keys) if k not in self._vectors]
        if missing:
            memory, query = search([texts[i] for i in missing])
            for i, m, q in zip(missing, memory, query, strict=True):
                self._vectors.setdefault(self._key(texts[i]), m)
                self._vectors[query_keys[i]] = q
            self._dirty = True
        query_vectors = np.stack([self._vectors[k] for k in query_keys]).astype(np.float32)  # [n, dim]
        return self.embed(texts), query_vectors

    @staticmethod
    def query_key(tag: str, text: str) -> str:
        """The key a query vector of pooling `tag` (an embedder's `query_name`) is filed under."""
        return hashlib.sha1(f"query:{tag}:{text}".encode()).hexdigest()

    def put_query(self, tag: str, text: str, vector: np.ndarray) -> None:
        """Files `vector` as the query vector of `text` under pooling `tag` (train_query_head's held-out
        vectors, so rerank_train fits on them)."""
        self._vectors[self.query_key(tag, text)] = np.asarray(vector, dtype=np.float32)
        self._dirty = True

    def save(self) -> None:
        if self._path is None or not self._dirty:
            return
        keys = sorted(self._vectors)
        self._path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self._path.with_name(self._path.name + ".tmp.npz")
        np.savez(tmp, keys=np.array(keys), vectors=np.stack([self._vectors[k] for k in keys]))
        tmp.replace(self._path)
        self._dirty = False


SPEAKER_IN = ("role", "metadata")


def load_conversations(
    store: MemoryStore, conversations: list[Conversation], speaker_in: str = "role"
) -> dict[str, dict[str, str]]:
    """Adds every conversation (one user each) session by session; returns user -> dia_id -> memory id.

    speaker_in 'role': each turn is a chat message whose role is the speaker's name; 'metadata': as an import
    of a multi-party log, role 'user' with the speaker in the memory's metadata (one add per run of turns by
    the same speaker, since metadata is per add call)."""
    assert speaker_in in SPEAKER_IN, speaker_in
    ids: dict[str, dict[str, str]] = {}
    for conversation in conversations:
        user_id = f"realtalk/{conversation.name}"
        ids[user_id] = {}
        for session in conversation.sessions:
            runs = [[t] for t in session.turns] if speaker_in == "metadata" else [list(session.turns)]
            if speaker_in == "metadata":
                merged: list[list] = []
                for run in runs:
                    if merged and merged[-1][0].speaker == run[0].speaker:
                        merged[-1].extend(run)
                    else:
                        merged.append(run)
                runs = merged
            for run in runs:
                memories = store.add(
                    user_id,
                    messages=[
                        {
                            "role": "user" if speaker_in == "metadata" else t.speaker,
                            "content": t.text,
                            "chat_time": t.chat_time,
                        }
                        for t in run
                    ],
                    session_id=session.session_id,
                    metadata={"speaker": run[0].speaker} if speaker_in == "metadata" else None,
                )
                for turn, memory in zip(run, memories, strict=True):
                    ids[user_id][turn.dia_id] = memory.id
    return ids


def speaker_probe(
    store: MemoryStore, conversations: list[Conversation], ids: dict[str, dict[str, str]]
) -> dict:
    """Hybrid recall@10 on the questions that name exactly one of the chat's two speakers ('named'), and on the
    same questions with that name swapped for the other speaker's ('wrong_name', scored against the same
    evidence): a speaker lift that is too strong wins on the first and collapses on the second."""
    named: list[QuestionScore] = []
    wrong: list[QuestionScore] = []
    for conversation in conversations:
        user_id = f"realtalk/{conversation.name}"
        speakers = sorted({t.speaker for s in conversation.sessions for t in s.turns})
        if len(speakers) != 2:
            continue
        for question in conversation.questions:
            words = {w.lower() for w in re.findall(r"\w+", question.text)}
            hit = [s for s in speakers if s.lower() in words]
            if not question.evidence or len(hit) != 1:
                continue
            other = speakers[1 - speakers.index(hit[0])]
            swapped = re.sub(rf"\b{re.escape(hit[0])}\b", other, question.text, flags=re.IGNORECASE)
            evidence = [ids[user_id][e] for e in question.evidence]
            for text, out in ((question.text, named), (swapped, wrong)):
                ranked = [h.memory.id for h in store.search(user_id, text, top_k=max(KS))]
                out.append(score_ranking(ranked, evidence))
    return {"named": summarize(named), "wrong_name": summarize(wrong)}


def evaluate(
    store: MemoryStore, conversations: list[Conversation], ids: dict[str, dict[str, str]], modes=MODES
) -> dict:
    """Scores every question with evidence in every mode: overall and per category, plus search latency."""
    result: dict = {}
    for mode in modes:
        overall: list[QuestionScore] = []
        by_category: dict[str, list[QuestionScore]] = defaultdict(list)
        timings: list[float] = []
        config = store.config
        if mode == "first_stage":
            store.config = dataclasses.replace(config, rerank="none")
        for conversation in conversations:
            user_id = f"realtalk/{conversation.name}"
            for question in conversation.questions:
                if not question.evidence:
                    continue
                start = time.perf_counter()
                hits = store.search(
                    user_id, question.text, top_k=max(KS), mode=mode.replace("first_stage", "hybrid")
                )
                timings.append(time.perf_counter() - start)
                ranked = [h.memory.id for h in hits]
                score = score_ranking(ranked, [ids[user_id][e] for e in question.evidence])
                overall.append(score)
                by_category[question.category].append(score)
        store.config = config
        result[mode] = summarize(overall)
        result[mode]["by_category"] = {c: summarize(s) for c, s in sorted(by_category.items())}
        result[mode]["search_ms_p50"] = round(float(np.median(timings)) * 1000, 3) if timings else None
    return result


def dataset_stats(conversations: list[Conversation]) -> dict:
    questions = [q for c in conversations for q in c.questions]
    return {
        "conversations": [c.name for c in conversations],
        "num_turns": sum(c.num_turns for c in conversations),
        "num_sessions": sum(len(c.sessions) for c in conversations),
        "num_questions": len(questions),
        "num_questions_scored": sum(bool(q.evidence) for q in questions),
        "num_evidence_ids_dropped": sum(q.num_dropped_evidence for q in questions),
    }


def parse_overrides(pairs: list[str]) -> dict:
    """['rrf_k=60', 'keyword_weight=1'] -> {'rrf_k': 60, 'keyword_weight': 1.0}, typed by the config field."""
    fields = {f.name: f for f in dataclasses.fields(TextStoreConfig)}
    out = {}
    for pair in pairs:
        name, _, value = pair.partition("=")
        if name not in fields:
            raise SystemExit(f"--set: unknown TextStoreConfig field {name!r}; known: {sorted(fields)}")
        default = getattr(TextStoreConfig(), name)
        if isinstance(default, bool):
            out[name] = value.lower() in ("1", "true", "yes")
        elif isinstance(default, (int, float)):
            out[name] = type(default)(float(value)) if isinstance(default, int) else float(value)
        else:
            out[name] = value
    return out


def run(
    data_dir: Path,
    split: str,
    embedder_spec: str,
    overrides: dict,
    vector_cache: Path | None,
    workdir: Path | None = None,
    speaker_in: str = "role",
) -> dict:
    conversations = load_split(data_dir, split)
    base = load_embedder(embedder_spec)
    embedder = CachedEmbedder(base, vector_cache)
    config = TextStoreConfig(**overrides)
    with tempfile.TemporaryDirectory(prefix="kvmem-recall-bench-") as tmp:
        path = Path(workdir or tmp) / "recall.db"
        start = time.perf_counter()
        with MemoryStore(path, embedder=embedder, config=config) as store:
            ids = load_conversations(store, conversations, speaker_in)
            embedder.save()
            load_s = time.perf_counter() - start
            recall = evaluate(store, conversations, ids)
            probe = speaker_probe(store, conversations, ids)
            embedder.save()
    keyword, dense, first_stage, hybrid = (recall[m]["recall@10"] for m in MODES)
    return {
        "benchmark": "kvmem.text recall on real conversations",
        "git_sha": git_sha(),
        "loadavg": [round(v, 2) for v in os.getloadavg()],
        "dataset": {
            "name": "REALTALK",
            "source": REALTALK_REPO,
            "commit": REALTALK_COMMIT,
            "split": split,
            "speaker_in": speaker_in,
            **dataset_stats(conversations),
        },
        "embedder": embedder.name,
        "config": dataclasses.asdict(config),
        "load_s": round(load_s, 2),
        "recall": recall,
        "hybrid_margin_at_10": round(hybrid - max(keyword, dense), 4),
        "margin_at_10": {
            "over_keyword": round(hybrid - keyword, 4),
            "over_dense": round(hybrid - dense, 4),
            "over_first_stage": round(hybrid - first_stage, 4),
        },
        "speaker_probe": probe,
    }


def print_table(result: dict) -> None:
    ds = result["dataset"]
    print(
        f"{ds['name']} split={ds['split']}: {len(ds['conversations'])} conversations, {ds['num_turns']} turns, "
        f"{ds['num_questions_scored']} questions scored; embedder {result['embedder']}; git {result['git_sha']}"
    )
    recall = result["recall"]
    categories = sorted(recall["hybrid"]["by_category"])
    header = f"{'mode':8s} {'R@5':>7s} {'R@10':>7s} {'MRR':>7s} " + " ".join(
        f"{'cat' + c + ' R@10':>11s}" for c in categories
    )
    print(header)
    print("-" * len(header))
    for mode in MODES:
        r = recall[mode]
        cats = " ".join(f"{r['by_category'][c]['recall@10']:11.3f}" for c in categories)
        print(f"{mode:8s} {r['recall@5']:7.3f} {r['recall@10']:7.3f} {r['mrr']:7.3f} {cats}")
    print(f"hybrid R@10 minus the best single leg: {result['hybrid_margin_at_10']:+.3f}")
    margin = result["margin_at_10"]
    print(
        f"hybrid R@10 minus keyword {margin['over_keyword']:+.3f}, dense {margin['over_dense']:+.3f}, "
        f"first stage {margin['over_first_stage']:+.3f}"
    )
    probe = result["speaker_probe"]
    print(
        f"questions naming one speaker ({probe['named'].get('num_questions', 0)}): R@10 "
        f"{probe['named'].get('recall@10', float('nan')):.3f}; the other speaker named instead: "
        f"{probe['wrong_name'].get('recall@10', float('nan')):.3f}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR)
    parser.add_argument("--split", default="report", choices=("tune", "report", "all"))
    parser.add_argument(
        "--embedder",
        default="default",
        help="default | minilm-onnx-plain (no query head) | minilm | hash | a model directory",
    )
    parser.add_argument(
        "--set", action="append", default=[], metavar="FIELD=VALUE", help="TextStoreConfig field"
    )
    parser.add_argument(
        "--vector-cache", type=Path, default=None, help="npz of text vectors reused across runs"
    )
    parser.add_argument(
        "--speaker-in", default="role", choices=SPEAKER_IN, help="where a turn's speaker goes"
    )
    parser.add_argument("--out", default=None, help="write the JSON result here")
    args = parser.parse_args(argv)
    result = run(
        args.data_dir,
        args.split,
        args.embedder,
        parse_overrides(args.set),
        args.vector_cache,
        speaker_in=args.speaker_in,
    )
    print_table(result)
    write_outputs(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Retrieval recall over FORMED memories (credited through their source turns) vs over RAW turns, on REALTALK.

Run: python -m benchmarks.memory.formed_recall --split report --out benchmarks/results/cpu/formed_recall.json
With the served model forming (`--extractor self`, issue 45): add `--self-model demo` (the demo model in this
process's engine, one torch thread; formed once, no 'both' store; hours on a busy CPU: `--limit-chats N` bounds it).
Each conversation is one user (as in benchmarks.memory.recall_bench), in three stores sharing one embedder:
  raw:    every turn added as a memory (recall_bench's load_conversations); a hit is credited with its turn.
  formed: every turn logged (store.log_turns, role 'user' for both speakers, since both are people; name = the
          speaker; chat_time = the turn's), then FormationWorker(store, RuleExtractor(),
          FormationConfig(batch_turns=64)).form_user repeated until no turn is pending. A hit is credited with
          ALL its source turns' dia_ids, in rank order, de-duplicated, cut at 10 dia_ids. The formation's
          `coverage` is recall's ceiling here: the share of evidence turns that formed a current memory.
  both:   the formed memories (formed first, so consolidation sees only formed ones) plus every raw turn added
          as a memory, in one store; raw hits credited with their turn, formed hits with their source turns.
Each question with evidence is searched as written (top_k 10, hybrid) and scored with recall_bench's
score_ranking (recall@5/@10 over the credited dia_ids, MRR@10). Prints a table; the last stdout line is one
JSON document (git sha included).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from benchmarks.common import git_sha, write_outputs
from benchmarks.memory.conversations import REALTALK_COMMIT, REALTALK_REPO, Conversation, load_split
from benchmarks.memory.recall_bench import (
    DEFAULT_DATA_DIR,
    KS,
    CachedEmbedder,
    QuestionScore,
    dataset_stats,
    load_conversations,
    score_ranking,
    summarize,
)
from kvmem.formation.rules import RuleExtractor
from kvmem.text import MemoryStore, TextStoreConfig, load_embedder
from scheduler.formation import FormationConfig, FormationWorker

MODES = ("raw", "formed", "both")
TOP_K = max(KS)
BATCH_TURNS = 64


def user_of(conversation: Conversation) -> str:
    return f"realtalk/{conversation.name}"


def log_and_form(
    store: MemoryStore, conversations: list[Conversation], extractor=None
) -> tuple[dict[str, dict[str, str]], dict]:
    """Logs every turn and forms them; returns user -> log turn id -> dia_id, and formation figures.
    `extractor`: the rules (None) or self_model.ModelExtractor, whose own decider then decides the updates
    (as the server's formation does for `--extractor self`)."""
    config = FormationConfig(batch_turns=BATCH_TURNS)
    if extractor is None:
        worker = FormationWorker(store, RuleExtractor(), config)
    else:
        worker = FormationWorker(store, extractor, config, decider=extractor.decide)
    turn_dia: dict[str, dict[str, str]] = {}
    totals = dict.fromkeys(
        ("passes", "turns_formed", "added", "duplicates", "superseded", "dropped", "failed_passes"), 0
    )
    start = time.perf_counter()
    for conversation in conversations:
        user_id = user_of(conversation)
        turn_dia[user_id] = {}
        for session in conversation.sessions:
            logged = store.log_turns(
                user_id,
                [
                    {"role": "user", "content": t.text, "chat_time": t.chat_time, "name": t.speaker}
                    for t in session.turns
                ],
                session_id=session.session_id,
            )
            for turn, entry in zip(session.turns, logged, strict=True):
                turn_dia[user_id][entry.id] = turn.dia_id
    log_s = time.perf_counter() - start
    start = time.perf_counter()
    for conversation in conversations:
        user_id = user_of(conversation)
        while store.pending_turns(user_id, limit=1):
            result = worker.form_user(user_id)
            totals["passes"] += 1
            totals["turns_formed"] += result.num_turns
            totals["added"] += result.num_added
            totals["duplicates"] += result.num_duplicates
            totals["superseded"] += result.num_superseded
            totals["dropped"] += result.num_dropped
            totals["failed_passes"] += result.error is not None
    form_s = time.perf_counter() - start
    live = sum(store.count(user_of(c)) for c in conversations)
    return turn_dia, {
        **totals,
        "memories_live": live,  # superseded ones included (they are not searched)
        "memories_served": totals["added"] - totals["superseded"],
        "log_s": round(log_s, 3),
        "formation_s": round(form_s, 3),
        "turns_per_s": round(totals["turns_formed"] / form_s, 1) if form_s > 0 else None,
    }


def credit(hits, raw_dia: dict[str, str], turn_dia: dict[str, str], limit: int = TOP_K) -> list[str]:
    """Hits -> dia_ids in rank order: a raw memory its turn, a formed one all its source turns; de-duplicated,
    cut at `limit`."""
    out: list[str] = []
    seen: set[str] = set()
    for hit in hits:
        memory = hit.memory
        if memory.id in raw_dia:
            dias = [raw_dia[memory.id]]
        else:
            dias = [turn_dia[t] for t in memory.source_turn_ids if t in turn_dia]
        for dia in dias:
            if dia not in seen:
                seen.add(dia)
                out.append(dia)
    return out[:limit]


def current_memories(store: MemoryStore, user_id: str) -> list:
    """Every current memory of the user (superseded ones left out: they are not searched)."""
    out: list = []
    page = 1
    while True:
        listed = store.list(user_id, page=page, page_size=store.config.max_page_size)
        out += listed.items
        if len(out) >= listed.total or not listed.items:
            return out
        page += 1


def evidence_coverage(
    store: MemoryStore, conversations: list[Conversation], turn_dia: dict[str, dict[str, str]]
) -> dict:
    """The ceiling formation puts on recall: of the scored questions' evidence turns, the share that are a source
    turn of a current memory (a turn that formed none cannot be credited through one, whatever the ranking),
    and the share of questions with all / any of their evidence so covered."""
    turns = questions = every = some = covered = 0
    for conversation in conversations:
        user_id = user_of(conversation)
        dias = turn_dia.get(user_id, {})
        sourced = {dias[t] for m in current_memories(store, user_id) for t in m.source_turn_ids if t in dias}
        for question in conversation.questions:
            if not question.evidence:
                continue
            hit = sum(d in sourced for d in question.evidence)
            questions += 1
            turns += len(question.evidence)
            covered += hit
            every += hit == len(question.evidence)
            some += hit > 0
    return {
        "evidence_turns": turns,
        "evidence_turns_with_a_memory": round(covered / turns, 4) if turns else None,
        "questions_all_evidence_with_a_memory": round(every / questions, 4) if questions else None,
        "questions_any_evidence_with_a_memory": round(some / questions, 4) if questions else None,
    }


def evaluate(
    store: MemoryStore,
    conversations: list[Conversation],
    raw_dia: dict[str, dict[str, str]],
    turn_dia: dict[str, dict[str, str]],
) -> dict:
    overall: list[QuestionScore] = []
    by_category: dict[str, list[QuestionScore]] = defaultdict(list)
    timings: list[float] = []
    credited: list[int] = []
    for conversation in conversations:
        user_id = user_of(conversation)
        for question in conversation.questions:
            if not question.evidence:
                continue
            start = time.perf_counter()
            hits = store.search(user_id, question.text, top_k=TOP_K, mode="hybrid")
            timings.append(time.perf_counter() - start)
            ranked = credit(hits, raw_dia.get(user_id, {}), turn_dia.get(user_id, {}))
            credited.append(len(ranked))
            score = score_ranking(ranked, list(question.evidence))
            overall.append(score)
            by_category[question.category].append(score)
    out = summarize(overall)
    out["by_category"] = {c: summarize(s) for c, s in sorted(by_category.items())}
    out["search_ms_p50"] = round(float(np.median(timings)) * 1000, 3) if timings else None
    out["mean_dia_ids_credited"] = round(float(np.mean(credited)), 2) if credited else None
    return out


def run(
    data_dir: Path,
    split: str,
    embedder_spec: str,
    vector_cache: Path | None,
    limit_chats: int | None = None,
    self_model: str | None = None,
) -> dict:
    conversations = load_split(data_dir, split)
    if limit_chats is not None:
        conversations = conversations[:limit_chats]
    embedder = CachedEmbedder(load_embedder(embedder_spec), vector_cache)  # one embedder for all three stores
    config = TextStoreConfig()
    loadavg_start = list(os.getloadavg())
    extractor = None if self_model is None else self_extractor(self_model)
    recall: dict = {}
    formation: dict = {}
    timing: dict = {}
    with tempfile.TemporaryDirectory(prefix="kvmem-formed-recall-") as tmp:
        # raw
        start = time.perf_counter()
        with MemoryStore(Path(tmp) / "raw.db", embedder=embedder, config=config) as store:
            ids = load_conversations(store, conversations)  # user -> dia_id -> memory id
            raw_dia = {u: {m: d for d, m in by_dia.items()} for u, by_dia in ids.items()}
            timing["raw_load_s"] = round(time.perf_counter() - start, 3)
            embedder.save()
            recall["raw"] = evaluate(store, conversations, raw_dia, {})
        # formed
        with MemoryStore(Path(tmp) / "formed.db", embedder=embedder, config=config) as store:
            turn_dia, formation["formed"] = log_and_form(store, conversations, extractor)
            embedder.save()
            recall["formed"] = evaluate(store, conversations, {}, turn_dia)
            formation["formed"]["coverage"] = evidence_coverage(store, conversations, turn_dia)
        # both: formed first (consolidation sees formed memories only), then the raw turns as memories;
        # not with --self-model (a second LLM formation of every turn)
        with MemoryStore(Path(tmp) / "both.db", embedder=embedder, config=config) as store:
            if extractor is not None:
                recall["both"] = {"skipped": "--self-model: formed once only"}
                return _result(
                    split, conversations, embedder, extractor, formation, timing, loadavg_start, recall
                )
            turn_dia, formation["both"] = log_and_form(store, conversations)
            ids = load_conversations(store, conversations)
            raw_dia = {u: {m: d for d, m in by_dia.items()} for u, by_dia in ids.items()}
            embedder.save()
            recall["both"] = evaluate(store, conversations, raw_dia, turn_dia)
    return _result(split, conversations, embedder, extractor, formation, timing, loadavg_start, recall)


def self_extractor(model: str):
    """The `self` extractor over a TransformersBackend of `model` (a dir; 'demo': the provisioned demo model),
    through the server's code (serving/background/self_generate.py), one torch thread."""
    import torch

    from kvmem.formation.self_model import ModelExtractor
    from kvmem.models import provision_demo_model
    from serving.backends.transformers.backend import TransformersBackend, TransformersBackendConfig
    from serving.background.self_generate import backend_generate

    torch.set_num_threads(1)
    model = str(provision_demo_model()) if model == "demo" else model
    backend = TransformersBackend(
        TransformersBackendConfig(
            model=model, data_dir=tempfile.mkdtemp(prefix="kvmem-self-"), dtype="float32"
        )
    )
    backend.load()
    extractor = ModelExtractor(backend_generate(backend))
    extractor.model = model
    return extractor


def _result(split, conversations, embedder, extractor, formation, timing, loadavg_start, recall) -> dict:
    stats = dataset_stats(conversations)
    formed = formation["formed"]
    return {
        "benchmark": "kvmem recall over formed memories (credited via source turns) vs raw turns",
        "git_sha": git_sha(),
        "dataset": {
            "name": "REALTALK",
            "source": REALTALK_REPO,
            "commit": REALTALK_COMMIT,
            "split": split,
            **stats,
        },
        "embedder": embedder.name,
        "extractor": RuleExtractor().name if extractor is None else f"self:{extractor.model}",
        "formation_config": {"batch_turns": BATCH_TURNS},
        "search": {"mode": "hybrid", "top_k": TOP_K, "credit_cut": TOP_K},
        "num_turns": stats["num_turns"],
        "num_formed_memories": formed["added"],
        "num_formed_served": formed["memories_served"],
        "formed_per_turn": round(formed["added"] / stats["num_turns"], 4) if stats["num_turns"] else None,
        "formation": formation,
        "timing": timing,
        "loadavg_start": loadavg_start,
        "loadavg_end": list(os.getloadavg()),
        "cpu_count": os.cpu_count(),
        "recall": recall,
    }


def print_table(result: dict) -> None:
    ds = result["dataset"]
    formed = result["formation"]["formed"]
    print(
        f"{ds['name']} split={ds['split']}: {len(ds['conversations'])} conversations, {ds['num_turns']} turns, "
        f"{ds['num_questions_scored']} questions scored; embedder {result['embedder']}; git {result['git_sha']}"
    )
    print(
        f"formed: {formed['added']} memories from {formed['turns_formed']} turns ({formed['memories_served']} "
        f"served, {formed['duplicates']} duplicates, {formed['superseded']} superseded) in "
        f"{formed['formation_s']:.2f} s; loadavg {result['loadavg_start'][0]:.2f} -> {result['loadavg_end'][0]:.2f}"
    )
    if "coverage" in formed:
        c = formed["coverage"]
        print(
            f"evidence turns with a formed memory {c['evidence_turns_with_a_memory']} (recall's ceiling); questions "
            f"with all of theirs {c['questions_all_evidence_with_a_memory']}, with any "
            f"{c['questions_any_evidence_with_a_memory']}"
        )
    recall = result["recall"]
    categories = sorted(recall["raw"]["by_category"])
    header = f"{'mode':8s} {'R@5':>7s} {'R@10':>7s} {'MRR':>7s} " + " ".join(
        f"{'cat' + c + ' R@10':>11s}" for c in categories
    )
    print(header)
    print("-" * len(header))
    for mode in MODES:
        r = recall[mode]
        if "skipped" in r:
            print(f"{mode:8s} skipped: {r['skipped']}")
            continue
        cats = " ".join(
            f"{r['by_category'].get(c, {}).get('recall@10', float('nan')):11.3f}" for c in categories
        )
        print(f"{mode:8s} {r['recall@5']:7.3f} {r['recall@10']:7.3f} {r['mrr']:7.3f} {cats}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR)
    parser.add_argument("--split", default="report", choices=("tune", "report", "all"))
    parser.add_argument("--embedder", default="default", help="default | minilm | hash | a model directory")
    parser.add_argument(
        "--vector-cache", type=Path, default=None, help="npz of text vectors reused across runs"
    )
    parser.add_argument("--limit-chats", type=int, default=None, help="only the first N conversations")
    parser.add_argument(
        "--self-model",
        default=None,
        help="form with the self extractor over this model (a dir, or 'demo') in this process's engine; the "
        "'both' store is skipped",
    )
    parser.add_argument("--out", default=None, help="write the JSON result here")
    args = parser.parse_args(argv)
    result = run(
        args.data_dir, args.split, args.embedder, args.vector_cache, args.limit_chats, args.self_model
    )
    print_table(result)
    write_outputs(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

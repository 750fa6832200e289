"""Plaintext store benchmark: add and search latency, bulk import rate, and retrieval recall by search mode.

Run: python -m benchmarks.tiers.store_bench [--quick] [--seed N] --out FILE.json
     python -m benchmarks.tiers.store_bench --recall-only --seed 1 [--rrf-k K --keyword-weight W --dense-weight W]
       --out FILE.json   (the fusion development split: recall only, another fusion setting)
Fixed seed, warm-up before timing, p50/p90. Prints a table; the last stdout line is one JSON document.
Figures: add p50 (embedding included), search p50 for one user with 10k memories among 100k in the file,
import rate of 100k memories (progress bar), recall@5/@10 of keyword, dense and hybrid search on a synthetic
multi-session benchmark (benchmarks/memory/memory_dataset.py). Keyword and dense are the baselines, timed and
scored in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.common import OthersCpu, env_info
from benchmarks.memory.memory_dataset import Dataset, filler_texts, generate
from kvmem.text import Embedder, MemoryStore, TextStoreConfig, load_embedder
from kvmem.text.dump import encode_line
from kvmem.text.records import Memory

MODES = ("keyword", "dense", "hybrid")


@dataclass(frozen=True)
class Sizes:
    num_users: int  # recall benchmark users
    num_sessions: int
    turns_per_session: int
    num_adds: int
    bulk_total: int  # memories in the file for the search-latency and import figures
    bulk_big_user: int  # memories of the user whose searches are timed
    num_searches: int


FULL = Sizes(
    num_users=20,
    num_sessions=12,
    turns_per_session=60,
    num_adds=200,
    bulk_total=100_000,
    bulk_big_user=10_000,
    num_searches=200,
)
QUICK = Sizes(
    num_users=4,
    num_sessions=6,
    turns_per_session=30,
    num_adds=40,
    bulk_total=5_000,
    bulk_big_user=1_000,
    num_searches=40,
)


def percentiles_ms(seconds: list[float]) -> dict:
    ms = sorted(s * 1000 for s in seconds)
    return {
        "p50": round(statistics.median(ms), 3),
        "p90": round(float(np.percentile(ms, 90)), 3),
        "p99": round(float(np.percentile(ms, 99)), 3),
        "n": len(ms),
    }


def bench_add(embedder: Embedder, workdir: Path, num_adds: int, seed: int) -> dict:
    """Latency of single-text adds (distinct texts, so every add embeds), after a warm-up."""
    rng = random.Random(seed)
    texts = [f"{t} (note {i})" for i, t in enumerate(filler_texts(rng, num_adds + 20))]
    with MemoryStore(workdir / "add.db", embedder=embedder) as store:
        for text in texts[:20]:
            store.add("warmup", text)
        timings = []
        for text in texts[20:]:
            start = time.perf_counter()
            store.add("user-add", text, session_id="s1")
            timings.append(time.perf_counter() - start)
    return percentiles_ms(timings)


def write_bulk_dump(path: Path, embedder: Embedder, sizes: Sizes, seed: int) -> None:
    """A dump of `bulk_total` memories: one user with `bulk_big_user`, the rest spread over users of ~100.

    Texts are chatter with variations; vectors are the real embedder's (embedded once per distinct text).
    """
    rng = random.Random(seed)
    texts = filler_texts(rng, sizes.bulk_total)
    distinct = sorted(set(texts))
    vectors = dict(zip(distinct, embedder.embed(distinct), strict=True))
    with open(path, "w", encoding="utf-8") as fp:
        for i, text in enumerate(texts):
            user = "big-user" if i < sizes.bulk_big_user else f"bulk-{(i - sizes.bulk_big_user) // 100:05d}"
            when = f"2024-{1 + i % 12:02d}-{1 + i % 28:02d}T{i % 24:02d}:00:00.000000Z"
            memory = Memory(
                id=f"bulk{i:08d}",
                user_id=user,
                session_id=f"{user}/s{i % 50}",
                agent_id=None,
                role="user" if i % 2 == 0 else "assistant",
                text=text,
                created_at=when,
                chat_time=when,
                updated_at=when,
                tags=(),
                metadata={},
                state="active",
                version=1,
            )
            fp.write(
                encode_line(memory, [], embedder.name, vectors[text].astype(np.float32).tobytes()) + "\n"
            )


def bench_bulk(
    embedder: Embedder, workdir: Path, sizes: Sizes, seed: int, progress: bool
) -> tuple[dict, dict]:
    """Import rate of the bulk dump, then search latency for the big user, per mode."""
    dump = workdir / "bulk.jsonl"
    write_bulk_dump(dump, embedder, sizes, seed)
    with MemoryStore(workdir / "bulk.db", embedder=embedder) as store:
        start = time.perf_counter()
        count = store.import_jsonl(dump, progress=progress)
        seconds = time.perf_counter() - start
        imported = {
            "num_memories": count,
            "seconds": round(seconds, 2),
            "per_second": round(count / seconds, 1),
            "file_bytes": os.path.getsize(workdir / "bulk.db"),
        }
        questions = [q.text for q in generate(3, 6, 20, seed).questions]
        rng = random.Random(seed)
        search = {}
        for mode in MODES:  # distinct query strings everywhere, so no query embedding comes from the cache
            queries = [f"{rng.choice(questions)} ({mode} {i})" for i in range(sizes.num_searches + 20)]
            for query in queries[:20]:
                store.search("big-user", query, top_k=10, mode=mode)
            timings = []
            for query in queries[20:]:
                start = time.perf_counter()
                store.search("big-user", query, top_k=10, mode=mode)
                timings.append(time.perf_counter() - start)
            search[mode] = percentiles_ms(timings)
        search["big_user_memories"] = store.count("big-user")
        search["file_memories"] = count
    return imported, search


def bench_recall(embedder: Embedder, workdir: Path, dataset: Dataset, config: TextStoreConfig) -> dict:
    """recall@5 and @10 per mode: the share of a question's evidence turns found in the top k."""
    with MemoryStore(workdir / "recall.db", embedder=embedder, config=config) as store:
        key_to_id: dict[str, str] = {}
        by_session: dict[tuple[str, str], list] = {}
        for turn in dataset.turns:
            by_session.setdefault((turn.user_id, turn.session_id), []).append(turn)
        for (user_id, session_id), turns in by_session.items():
            memories = store.add(
                user_id,
                messages=[{"role": t.role, "content": t.text, "chat_time": t.chat_time} for t in turns],
                session_id=session_id,
            )
            for turn, memory in zip(turns, memories, strict=True):
                if turn.key:
                    key_to_id[turn.key] = memory.id
        result: dict = {
            "num_memories": len(dataset.turns),
            "num_questions": len(dataset.questions),
            "num_time_filtered": sum(q.time_range is not None for q in dataset.questions),
        }
        for mode in MODES:
            found = {5: [], 10: []}
            found_timed = {5: [], 10: []}
            for question in dataset.questions:
                filters = None
                if question.time_range is not None:
                    filters = {"time_range": {"start": question.time_range[0], "end": question.time_range[1]}}
                hits = store.search(question.user_id, question.text, top_k=10, filters=filters, mode=mode)
                ranked = [h.memory.id for h in hits]
                evidence = [key_to_id[k] for k in question.evidence_keys]
                for k in (5, 10):
                    share = sum(e in ranked[:k] for e in evidence) / len(evidence)
                    found[k].append(share)
                    if question.time_range is not None:
                        found_timed[k].append(share)
            result[mode] = {f"recall@{k}": round(float(np.mean(v)), 4) for k, v in found.items()}
            result[mode].update(
                {
                    f"time_filtered_recall@{k}": round(float(np.mean(v)), 4)
                    for k, v in found_timed.items()
                    if v
                }
            )
    return result


def run(
    sizes: Sizes,
    embedder_spec: str,
    seed: int,
    progress: bool,
    config: TextStoreConfig | None = None,
    recall_only: bool = False,
) -> dict:
    """`recall_only` skips the add, import and search-latency figures (None in the result)."""
    others = OthersCpu()
    others.start()
    embedder = load_embedder(embedder_spec)
    embedder.embed(["warm-up"])  # load the model before anything is timed
    config = config or TextStoreConfig()
    add = imported = search = None
    with tempfile.TemporaryDirectory(prefix="kvmem-store-bench-") as tmp:
        workdir = Path(tmp)
        if not recall_only:
            add = bench_add(embedder, workdir, sizes.num_adds, seed)
            imported, search = bench_bulk(embedder, workdir, sizes, seed, progress)
        dataset = generate(sizes.num_users, sizes.num_sessions, sizes.turns_per_session, seed)
        recall = bench_recall(embedder, workdir, dataset, config)
    return {
        "benchmark": "kvmem.text store",
        "seed": seed,
        "sizes": sizes.__dict__,
        "embedder": embedder.name,
        "fusion": {
            "method": config.fusion,
            "rrf_k": config.rrf_k,
            "keyword_weight": config.keyword_weight,
            "dense_weight": config.dense_weight,
            "num_candidates": config.num_candidates,
        },
        # other processes' share of the cores over the whole run: the machine is shared
        "env": {**env_info("cpu"), "others_cpu_share": others.share()},
        "add_ms": add,
        "search_ms": search,
        "import": imported,
        "recall": recall,
        "hybrid_beats_both": hybrid_beats_both(recall),
    }


def hybrid_beats_both(recall: dict) -> bool:
    """Hybrid's recall@5 and @10 are each above both keyword's and dense's."""
    return all(
        recall["hybrid"][f"recall@{k}"] > recall[m][f"recall@{k}"]
        for m in ("keyword", "dense")
        for k in (5, 10)
    )


def print_table(result: dict) -> None:
    print(f"embedder: {result['embedder']}   seed: {result['seed']}   fusion: {result['fusion']}")
    if result["add_ms"] is not None:
        print(f"{'figure':44s} {'p50 ms':>9s} {'p90 ms':>9s} {'p99 ms':>9s}")
        add = result["add_ms"]
        print(
            f"{'add (one text, embedding included)':44s} {add['p50']:9.2f} {add['p90']:9.2f} {add['p99']:9.2f}"
        )
        search = result["search_ms"]
        for mode in MODES:
            label = f"search {mode} ({search['big_user_memories']} of {search['file_memories']})"
            r = search[mode]
            print(f"{label:44s} {r['p50']:9.2f} {r['p90']:9.2f} {r['p99']:9.2f}")
        imp = result["import"]
        print(
            f"import: {imp['num_memories']} memories in {imp['seconds']} s = {imp['per_second']} memories/s"
        )
    rec = result["recall"]
    print(
        f"recall on {rec['num_questions']} questions ({rec['num_time_filtered']} time-filtered), "
        f"{rec['num_memories']} memories"
    )
    print(f"{'mode':10s} {'R@5':>7s} {'R@10':>7s} {'timeR@5':>8s} {'timeR@10':>9s}")
    for mode in MODES:
        r = rec[mode]
        print(
            f"{mode:10s} {r['recall@5']:7.3f} {r['recall@10']:7.3f} {r.get('time_filtered_recall@5', 0):8.3f} "
            f"{r.get('time_filtered_recall@10', 0):9.3f}"
        )
    print(f"hybrid beats both: {result['hybrid_beats_both']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (CI smoke run)")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON result here")
    parser.add_argument("--embedder", default="default", help="default | minilm | hash | a model directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--recall-only", action="store_true", help="only the recall figures")
    defaults = TextStoreConfig()
    parser.add_argument("--rrf-k", type=int, default=defaults.rrf_k)
    parser.add_argument("--keyword-weight", type=float, default=defaults.keyword_weight)
    parser.add_argument("--dense-weight", type=float, default=defaults.dense_weight)
    args = parser.parse_args(argv)
    config = TextStoreConfig(
        rrf_k=args.rrf_k, keyword_weight=args.keyword_weight, dense_weight=args.dense_weight
    )
    result = run(
        QUICK if args.quick else FULL,
        args.embedder,
        args.seed,
        progress=not args.no_progress,
        config=config,
        recall_only=args.recall_only,
    )
    print_table(result)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

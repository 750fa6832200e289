"""Search latency for one user with 10k memories among 100k, through MemoryStore (the code the routes call).

Run: python -m benchmarks.tiers.search_latency --out benchmarks/results/cpu/recall_bench/search_latency_rerank.json
The bulk memories are store_bench's (same texts, users and times), but their vectors are random unit vectors
filed under the real embedder's name, so nothing bulk is embedded (an exact scan costs the same whatever the
values); every query is embedded by the real embedder, distinct queries so none comes from a cache. Modes: keyword,
dense, before_issue28 (hybrid as configured before the second stage: the baseline), first_stage (hybrid
without its second stage), hybrid (with it: the store's default), hybrid_top200 (the second stage over the
top 200) and hybrid_new_words (hybrid with the store's per-user term cache emptied before each search: the
queries share words, so in the other keyword and hybrid modes every word after the first few searches is
answered from that cache; here each pays the keyword index, as every search did before the cache). Per mode:
wall time and this process's CPU time per search (all its threads: the embedder's pool too), p50 / p90 / p99, after 20 warm-up searches. CPU time is
what the search itself costs; wall time also holds the waits of a shared machine, whose load is recorded
(`others_cpu_share`: other processes' share of all cores over the run). The last stdout line is one JSON
document (git sha included). Then the index time: 100 adds of one chat message each to the same user
(embedding included), p50 / p90 / p99.

Backends: `--backends sqlite postgresql` times the same data on each, side by side (`backends` in the JSON;
with sqlite alone the figures stay at the top level, as before). PostgreSQL is a throwaway server on loopback
started here (kvmem/text/db/pg_server.py, as the tests' fixture; as root it runs as the `postgres` user), or
the database `--store postgresql://...` names (its memories tables must be empty). `--quick`: store_bench's
QUICK sizes (5k memories, 1k for the timed user), to check the script runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import random
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import OthersCpu, env_info, write_outputs
from benchmarks.memory.memory_dataset import generate
from benchmarks.tiers.store_bench import FULL, QUICK, write_bulk_dump
from kvmem.text import MemoryStore, load_embedder
from kvmem.text.db.dialect import is_postgres_url
from kvmem.text.db.pg_server import start_server

# first_stage: hybrid without its second stage (rerank='none'), timed in the same run as hybrid with it;
# before_issue28: hybrid as it was before the second stage (its first stage over 50 candidates per leg, speaker
# lift 0.3, no second stage): the baseline, timed in the same run
# hybrid_top200: the second stage over the top 200 (200 per leg), the depth not chosen
# hybrid_new_words: hybrid with every word's keyword matches read from the index (term caches emptied first)
MODES = ("keyword", "dense", "before_issue28", "first_stage", "hybrid", "hybrid_top200", "hybrid_new_words")
ARMS = {
    "first_stage": {"rerank": "none"},
    "before_issue28": {"rerank": "none", "num_candidates": 50, "speaker_weight": 0.3},
    "hybrid_top200": {"num_candidates": 200, "rerank_depth": 200},
    "hybrid_new_words": {},
}
NUM_ADDS = 100


class RandomVectors:
    """Unit vectors drawn from each text's hash, under another embedder's name and dim (bulk data only)."""

    def __init__(self, name: str, dim: int) -> None:
        self.name, self.dim = name, dim

    def embed(self, texts: list[str]) -> np.ndarray:
        out = np.empty((len(texts), self.dim), dtype=np.float32)  # [n, dim]
        for i, text in enumerate(texts):
            seed = int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "little")
            v = np.random.default_rng(seed).standard_normal(self.dim).astype(np.float32)
            out[i] = v / np.linalg.norm(v)
        return out


def pct(values: list[float]) -> dict:
    ms = np.array(values) * 1000
    return {f"p{q}": round(float(np.percentile(ms, q)), 3) for q in (50, 90, 99)} | {"n": len(values)}


def measure(store: MemoryStore, searches: int, seed: int) -> dict:
    """Every mode's search latency for big-user, then the add latency (the docstring's figures)."""
    figures: dict = {}
    questions = [q.text for q in generate(3, 6, 20, seed).questions]
    rng = random.Random(seed)
    config = store.config
    for mode in MODES:
        queries = [f"{rng.choice(questions)} ({mode} {i})" for i in range(searches + 20)]
        wall, cpu = [], []
        store.config = dataclasses.replace(config, **ARMS.get(mode, {}))
        for i, query in enumerate(queries):
            if mode == "hybrid_new_words":
                store._vectors.forget_terms()  # untimed; the cached rows stay
            w0, c0 = time.perf_counter(), time.process_time()
            store.search("big-user", query, top_k=10, mode="hybrid" if mode in ARMS else mode)
            if i >= 20:
                wall.append(time.perf_counter() - w0)
                cpu.append(time.process_time() - c0)
        slowest = sorted(range(len(cpu)), key=lambda j: -cpu[j])[:3]
        figures[mode] = {
            "wall_ms": pct(wall),
            "cpu_ms": pct(cpu),
            "slowest_cpu": [[queries[20 + j], round(cpu[j] * 1000, 3)] for j in slowest],
        }
        print(mode, figures[mode], flush=True)
    store.config = config
    adds = []  # index time per memory: one chat message per add, embedding included
    for i in range(NUM_ADDS + 5):
        w0 = time.perf_counter()
        store.add("big-user", messages=[{"role": "user", "content": f"{rng.choice(questions)} ({i})"}])
        if i >= 5:
            adds.append(time.perf_counter() - w0)
    figures["add_wall_ms"] = pct(adds)
    print("add", figures["add_wall_ms"], flush=True)
    figures["big_user_memories"] = store.count("big-user")
    figures["file_memories"] = sum(store.count_by_user().values())
    return figures


def print_table(backends: dict[str, dict]) -> None:
    """Wall p50 / p90 ms per mode, one column per backend."""
    names = list(backends)
    print(f"{'mode':<16}" + "".join(f"{name + ' p50/p90 ms':>26}" for name in names))
    for mode in (*MODES, "add_wall_ms"):
        cells = []
        for name in names:
            ms = backends[name][mode] if mode == "add_wall_ms" else backends[name][mode]["wall_ms"]
            cells.append(f"{ms['p50']:>12.2f} / {ms['p90']:<10.2f}")
        print(f"{mode:<16}" + "".join(f"{c:>26}" for c in cells))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--searches", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--quick", action="store_true", help="store_bench's QUICK sizes (a check, not figures)"
    )
    parser.add_argument(
        "--backends", nargs="+", choices=("sqlite", "postgresql"), default=["sqlite"], help="stores to time"
    )
    parser.add_argument(
        "--store",
        default=None,
        help="postgresql://... to time instead of a server started here (empty tables)",
    )
    args = parser.parse_args(argv)
    if args.searches < 1:
        parser.error(f"--searches must be >= 1, got {args.searches}")
    if args.store is not None and not is_postgres_url(args.store):
        parser.error(f"--store must be a postgresql:// URL, got {args.store!r}")
    sizes = QUICK if args.quick else FULL
    others = OthersCpu()
    others.start()
    embedder = load_embedder("default")
    embedder.embed(["warm-up"])
    result: dict = {
        "benchmark": "kvmem.text search latency",
        "sizes": sizes.__dict__,
        "embedder": embedder.name,
    }
    backends: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="kvmem-search-latency-") as tmp:
        dump = Path(tmp) / "bulk.jsonl"
        write_bulk_dump(dump, RandomVectors(embedder.name, embedder.dim), sizes, args.seed)
        for backend in args.backends:
            server = None
            if backend == "sqlite":
                location = str(Path(tmp) / "bulk.db")
            elif args.store is not None:
                location = args.store
            else:
                server = start_server()
                location = server.create_database("search_latency")
            try:
                with MemoryStore(location, embedder=embedder) as store:
                    t0 = time.perf_counter()
                    store.import_jsonl(dump)
                    print(f"{backend}: imported in {time.perf_counter() - t0:.1f} s", flush=True)
                    backends[backend] = {"import_s": round(time.perf_counter() - t0, 3)}
                    backends[backend] |= measure(store, args.searches, args.seed)
            finally:
                if server is not None:
                    server.close()
    if args.backends == ["sqlite"]:
        result.update(backends["sqlite"])  # the layout of the runs before PostgreSQL
    else:
        result["backends"] = backends
    print_table(backends)
    result["env"] = {**env_info("cpu"), "others_cpu_share": others.share()}
    write_outputs(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

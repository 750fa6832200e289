"""A/B search latency, one user with 10k memories among 100k: new hybrid defaults vs the old settings.

Run: python -m benchmarks.tiers.search_latency_ab OUT.json  (queries interleaved, so both meet the same load)
"""

import json
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import git_sha
from benchmarks.memory.memory_dataset import generate
from benchmarks.tiers.store_bench import FULL, percentiles_ms, write_bulk_dump
from kvmem.text import MemoryStore, TextStoreConfig, load_embedder

emb = load_embedder("default")
emb.embed(["warm-up"])
out = {"git_sha": git_sha()}
with tempfile.TemporaryDirectory() as tmp:
    dump = Path(tmp) / "bulk.jsonl"
    t = time.time()
    write_bulk_dump(dump, emb, FULL, 0)
    print("dump", time.time() - t, flush=True)
    with MemoryStore(Path(tmp) / "bulk.db", embedder=emb) as s0:
        s0.import_jsonl(dump)
    questions = [q.text for q in generate(3, 6, 20, 0).questions]
    rng = random.Random(0)
    configs = {
        "new_defaults": TextStoreConfig(),
        "old_equivalent": TextStoreConfig(
            rrf_k=5,
            keyword_weight=0.5,
            dense_weight=1.0,
            neighbour_weight=0.0,
            speaker_weight=0.0,
            num_keyword_candidates=50,
        ),
    }
    stores = {
        name: MemoryStore(Path(tmp) / "bulk.db", embedder=emb, config=cfg) for name, cfg in configs.items()
    }
    for mode in ("hybrid", "keyword", "dense"):
        names = list(stores) if mode == "hybrid" else ["new_defaults"]
        ts = {n: [] for n in names}
        queries = [f"{rng.choice(questions)} ({mode} {i})" for i in range(420)]
        for i, q in enumerate(queries):
            for n in names:  # interleaved, so both settings meet the same machine load
                qq = f"{q} {n}"
                t0 = time.perf_counter()
                stores[n].search("big-user", qq, top_k=10, mode=mode)
                dt = time.perf_counter() - t0
                if i >= 20:
                    ts[n].append(dt)
        for n in names:
            r = percentiles_ms(ts[n])
            r["p99"] = round(float(np.percentile([x * 1000 for x in ts[n]], 99)), 3)
            out[f"{n}/{mode}"] = r
            print(n, mode, r, flush=True)
Path(sys.argv[1]).write_text(json.dumps(out, indent=1))
print(json.dumps(out))

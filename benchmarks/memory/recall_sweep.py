"""Fusion settings tried on one split of the real-dialogue recall benchmark, in one run (the store is loaded once).

Run: python -m benchmarks.memory.recall_sweep --split tune --vector-cache V.npz --out out.json \
        --try "dense_neighbour_weight=0.5" --try "rrf_k=30,dense_weight=1.0" ...
Each --try is a set of TextStoreConfig overrides on top of the defaults (and --base); those are always scored
first. Each row also has the speaker probe (recall_bench.speaker_probe: questions naming one speaker, and the
same questions naming the other). Pick on 'tune', then report the pick once on 'report' with benchmarks.memory.recall_bench. The last stdout
line is one JSON document (git sha included).
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
from pathlib import Path

from benchmarks.common import git_sha, write_outputs
from benchmarks.memory.conversations import load_split
from benchmarks.memory.recall_bench import (
    DEFAULT_DATA_DIR,
    CachedEmbedder,
    evaluate,
    load_conversations,
    parse_overrides,
    speaker_probe,
)
from kvmem.text import MemoryStore, TextStoreConfig, load_embedder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR)
    parser.add_argument("--split", default="tune", choices=("tune", "report", "all"))
    parser.add_argument("--embedder", default="default")
    parser.add_argument("--vector-cache", type=Path, default=None)
    parser.add_argument("--try", dest="tries", action="append", default=[], metavar="F=V[,F=V...]")
    parser.add_argument("--base", default="", metavar="F=V[,F=V...]", help="overrides under every --try")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    base = parse_overrides([p for p in args.base.split(",") if p])
    conversations = load_split(args.data_dir, args.split)
    embedder = CachedEmbedder(load_embedder(args.embedder), args.vector_cache)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvmem-recall-sweep-") as tmp:
        with MemoryStore(Path(tmp) / "recall.db", embedder=embedder) as store:
            ids = load_conversations(store, conversations)
            embedder.save()
            for spec in ["", *args.tries]:
                overrides = parse_overrides([p for p in spec.split(",") if p])
                modes = ("keyword", "dense", "hybrid") if not rows else ("hybrid",)
                store.config = TextStoreConfig(**{**base, **overrides})
                recall = evaluate(store, conversations, ids, modes)
                if rows:
                    recall = {**rows[0]["recall"], "hybrid": recall["hybrid"]}
                best_leg = max(recall["keyword"]["recall@10"], recall["dense"]["recall@10"])
                probe = speaker_probe(store, conversations, ids)
                row = {
                    "overrides": overrides,
                    "recall": recall,
                    "hybrid_margin_at_10": round(recall["hybrid"]["recall@10"] - best_leg, 4),
                    "speaker_probe": probe,
                }
                rows.append(row)
                cats = {c: v["recall@10"] for c, v in recall["hybrid"]["by_category"].items()}
                print(
                    f"{spec or 'defaults':60s} hybrid R@10 {recall['hybrid']['recall@10']:.4f} "
                    f"margin {row['hybrid_margin_at_10']:+.4f} by category {cats} named / wrong name "
                    f"{probe['named'].get('recall@10')} / {probe['wrong_name'].get('recall@10')}",
                    flush=True,
                )
            embedder.save()
    result = {
        "benchmark": "kvmem.text recall sweep on real conversations",
        "git_sha": git_sha(),
        "split": args.split,
        "defaults": dataclasses.asdict(TextStoreConfig(**base)),
        "rows": rows,
    }
    write_outputs(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""`kvmem distill --data-dir D --user-id U [--all]`: one user's distillation job in the foreground.

Selection (with the server's heat from DATA_DIR/scheduler/heat.sqlite), training, gates, registry. Prints a
table, then as its last line one JSON object. Exit 0: activated; 3: not activated (a gate refused it, no
memory was selected, or a fact changed meanwhile); 2: bad arguments; 1: other errors.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path

EXIT_REFUSED = 3


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvmem distill", description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", type=Path, default=Path(".kvmem"), help="the server's data dir")
    p.add_argument(
        "--store",
        default=None,
        help="the server's memory store if not the data dir's: postgresql://user@host:port/db (heat is read "
        "from it too) or a SQLite file",
    )
    p.add_argument("--user-id", required=True, help="whose memories to distil")
    p.add_argument(
        "--all", action="store_true", help="every memory of the user up to the cap (no stability/use rule)"
    )
    p.add_argument("--model", default=None, help="model (default: the embedded default model)")
    p.add_argument("--max-facts", type=int, default=50, help="cap on facts per adapter (default 50)")
    p.add_argument(  # the server's TrainConfig.max_steps (train.py imports torch, so it is not imported here)
        "--max-steps",
        type=int,
        default=300,
        help="training steps at most (default 300, as the server trains)",
    )
    p.add_argument("--rank", type=int, default=8, help="LoRA rank (alpha = 2 x rank)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads for training (default 1)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def _table(outcome) -> str:
    rows = [("memory", "fact", "status")]
    chosen = {f.memory_id for f in outcome.selection.facts}
    for f in outcome.selection.facts:
        rows.append((f.memory_id[:12], f.text[:48], "distilled"))
    for mid, why in outcome.selection.skipped:
        if mid not in chosen:
            rows.append((mid[:12], "", f"skipped: {why}"))
    g = outcome.gates
    if g is not None:
        rows += [
            (
                "gate",
                "recall in context / adapter / base",
                f"{g.recall_in_context:.2f} / {g.recall_adapter:.2f} / {g.recall_base:.2f}",
            ),
            (
                "gate",
                "generic greedy agreement / KL",
                f"{g.greedy_agreement_generic:.3f} / {g.kl_generic:.4f}",
            ),
            (
                "gate",
                "facts served from the adapter",
                f"{len(g.served_ids)} of {len(outcome.selection.facts)}",
            ),
            (
                "gate",
                "confident wrong base / adapter",
                f"{g.confident_wrong_base} / {g.confident_wrong_adapter}",
            ),
        ]
    width = [max(len(str(r[i])) for r in rows) for i in range(3)]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, width, strict=True)) for r in rows)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # argparse: 2 on bad arguments, 0 on -h
        return int(exc.code or 0)
    if args.max_facts < 1 or args.max_steps < 1 or args.rank < 1 or args.threads < 1:
        sys.stderr.write("kvmem distill: --max-facts, --max-steps, --rank and --threads must be >= 1\n")
        return 2
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from kvmem.adapters import AdapterRegistry
    from kvmem.datadir import DataDir
    from kvmem.kv.layout import PromptLayout
    from kvmem.models import load_model
    from kvmem.text import MemoryStore
    from kvmem.text.db.dialect import check_store_location, is_postgres_url
    from scheduler.config import SchedulerConfig
    from scheduler.distill.job import DistillConfig, distill_user
    from scheduler.distill.selection import SelectConfig
    from scheduler.distill.train import TrainConfig
    from scheduler.heat import HeatTable

    data = DataDir.at(args.data_dir)
    try:
        location = check_store_location(args.store) if args.store is not None else str(data.text_db)
    except ValueError as exc:
        sys.stderr.write(f"kvmem distill: --store: {exc}\n")
        return 2
    on_postgres = is_postgres_url(location)
    if not on_postgres and not Path(location).exists():
        sys.stderr.write(f"kvmem distill: no memories at {location} (wrong --data-dir or --store?)\n")
        return 2
    store = MemoryStore(location)
    sched = SchedulerConfig()
    heat_path = data.scheduler_dir / "heat.sqlite"
    heat = HeatTable(
        location if on_postgres else heat_path if heat_path.exists() else None,
        half_life_s=sched.half_life_s,
        use_weight=sched.use_weight,
        recency_prior=sched.recency_prior,
    )
    logging.getLogger(__name__).info("kvmem distill: loading the model (CPU, float32)")
    handle = load_model(args.model, device="cpu", dtype="float32")
    config = DistillConfig(
        select=SelectConfig(
            min_stable_s=sched.distill_min_stable_s,
            min_uses=sched.distill_min_uses,
            max_facts=args.max_facts,
            half_life_s=sched.half_life_s,
        ),
        train=TrainConfig(rank=args.rank, max_steps=args.max_steps, seed=args.seed, num_threads=args.threads),
    )
    try:
        outcome = distill_user(
            args.user_id,
            store=store,
            registry=AdapterRegistry(data.adapters_dir),
            handle=handle,
            layout=PromptLayout(handle.tokenizer),
            stats=heat.stats(args.user_id),
            now=time.time(),
            config=config,
            every=args.all,
        )
    finally:
        heat.close()
        store.close()
    print(_table(outcome))
    print(json.dumps(outcome.summary()), flush=True)
    return 0 if outcome.activated else EXIT_REFUSED

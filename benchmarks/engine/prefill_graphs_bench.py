"""A KV-injected request's query-only forward through the engine, eager against static prefill
(serving/engine/prefill_graphs.py: CUDA graphs on a GPU, the same padded static chunk run eagerly on CPU), at
MemOS's nine cells (memory tokens x query tokens, benchmarks/ttft/memos_grid.py), on the layers the server
runs (`--path fast`, its default `--engine-layers auto`: the engine's own layers where the model takes them).

Per cell: a block of the cell's memory tokens built once (build_item, off the clock); then, per arm, --reps
requests each admitted over the block and prefilled in one chunk (runner.step, the engine's own step), timed
from the step's start to its token on the host (the first rep of each arm is a warm-up: the graph's capture).
Two more arms prefill the whole prompt (block and query, no memory KV) in one step: `full` with the static
chunks on (as the server runs on a GPU) and `full_eager` without: the TTFT the KV path saves against.
On CUDA one more, `static_mask`: the static chunk with its additive mask where it would take flash (`attention`:
flash or mask per static arm). Reported: median and p90 step ms per arm, the static arm's bucket (query tokens,
context) and whether graphs
replayed, and whether the first tokens of the arms are identical (they must be in float32; in bfloat16
the padded matmuls may round differently and a near-tie can flip: stated, not asserted); the reduction of the
faster KV arm against the faster full prefill (`kv_best`, `full_best`) beside MemOS's published figure for the
cell; and `floor` columns (benchmarks/gpu/floor.py): the query-only forward over the block for the eager and
static arms, the whole prompt's forward for the faster full arm, with each measured time over its floor.
Last line of stdout: the JSON written to --out (git sha, device and load average in `env`).

GPU (the suite's step, Qwen3-8B's shape, random weights):
    python -m benchmarks.engine.prefill_graphs_bench --random-preset qwen3-8b --device cuda --dtype bfloat16 \
        --out benchmarks/results/gpu/h200/prefill_graphs_qwen3_8b.json
CPU (the static chunk eager: its cost of padding, not graphs):
    python -m benchmarks.engine.prefill_graphs_bench --out benchmarks/results/cpu/prefill_graphs.json
Smoke (tiny shape): ... --random-preset smollm2-135m --cells 583x167 --reps 2 --out /tmp/pg.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks.common import env_info, median, p90, print_table, write_outputs
from benchmarks.gpu import floor as floors
from benchmarks.ttft.memos_grid import MEMOS_CTX, MEMOS_QUERY, MEMOS_QWEN3_8B, memories_for, query_for
from kvmem.kv import PromptLayout, Sampling, build_item
from serving.engine import models, runner
from serving.engine.pages import PagePool, PoolShape
from serving.engine.prefill_graphs import PrefillGraphs
from serving.engine.sequence import admit


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def one_request(model, pool, ids, item) -> tuple[float, int]:
    """Admit a request over `item` (None: no memory KV), prefill the rest of its prompt in one step; (seconds,
    its first token)."""
    sp = Sampling(max_new_tokens=1)
    *_, seq = admit(pool, model, ids, item=item, max_new_tokens=1, sampling=sp)
    device = pool.k.device
    _sync(device)
    start = time.perf_counter()
    (token,) = runner.step(model, pool, [seq], [])
    elapsed = time.perf_counter() - start  # the token is on the host: the step synced
    seq.release()
    return elapsed, int(token)


def run_cell(handle, pool, ctx: int, query: int, reps: int) -> dict:
    model, layout = handle.model, PromptLayout(handle.tokenizer)
    memories = memories_for(layout, ctx, seed=ctx)
    block = layout.block_ids(memories)
    item = build_item(handle, block, user_id="bench")
    ids = layout.prompt(memories, [], query_for(layout, memories, query, seed=query)).ids
    row: dict = {"ctx_tokens": len(block), "query_tokens": len(ids) - len(block)}
    # arm: (over the block's KV, static chunks on)
    arms = {
        "eager": (True, False),
        "static": (True, True),
        "full": (False, True),
        "full_eager": (False, False),
    }
    if pool.k.device.type == "cuda":  # the static chunk with its additive mask where flash could run
        arms["static_mask"] = (True, True)
    for arm, (injected, static) in arms.items():
        flash = arm != "static_mask"
        pool.prefill_graphs = PrefillGraphs(model, pool, flash=flash) if static else None
        times, tokens = [], []
        for _ in range(reps + 1):
            s, token = one_request(model, pool, ids, item if injected else None)
            times.append(s)
            tokens.append(token)
        row[f"{arm}_ms"] = median(times[1:]) * 1e3
        row[f"{arm}_p90_ms"] = p90(times[1:]) * 1e3
        row[f"{arm}_token"] = tokens[-1]
        if static:
            g = pool.prefill_graphs
            prefix = {"static": "", "full": "full_"}.get(arm, f"{arm}_")
            row[f"{prefix}bucket"] = sorted(g.buckets)
            row[f"{prefix}replayed"] = g.replays
            row[f"{prefix}failed"] = sorted(g.failed)
            # flash over packed sequences or the additive mask (prefill_graphs.StaticPrefillPlan.begin)
            flashed = {b.plan.offsets is not None for b in g.buckets.values()}
            row[f"{prefix}attention"] = (
                "flash" if flashed == {True} else "mask" if flashed == {False} else "both"
            )
    pool.prefill_graphs = None
    row["tokens_identical"] = row["eager_token"] == row["static_token"]
    row["full_token_identical"] = row["full_token"] == row["full_eager_token"] == row["static_token"]
    row["speedup"] = row["eager_ms"] / row["static_ms"]
    # against the engine's faster full prefill (static chunks or eager), the KV path's faster arm
    row["full_best"] = min(("full", "full_eager"), key=lambda a: row[f"{a}_ms"])
    row["kv_best"] = min(("static", "eager"), key=lambda a: row[f"{a}_ms"])
    row["reduction_pct"] = 100.0 * (1.0 - row[f"{row['kv_best']}_ms"] / row[f"{row['full_best']}_ms"])
    row["memos_speedup_pct"] = MEMOS_QWEN3_8B.get((ctx, query))  # MemOS's figure for the cell, Qwen3-8B
    shape, name = floors.shape_of(model), floors.device_name(pool.k.device)
    query_only = floors.step_cost(shape, [len(block)], [row["query_tokens"]])
    row["floor_eager"] = floors.floor(*query_only, name, measured_s=row["eager_ms"] / 1e3)
    row["floor_static"] = floors.floor(*query_only, name, measured_s=row["static_ms"] / 1e3)
    full_prefill = floors.step_cost(shape, [0], [len(ids)])
    row["floor_full"] = floors.floor(*full_prefill, name, measured_s=row[f"{row['full_best']}_ms"] / 1e3)
    return row


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a model id or path (default: the default model)")
    p.add_argument("--random-preset", default=None, help="benchmarks/ttft/random_models.py's presets")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="float32 on CPU, bfloat16 on CUDA by default")
    p.add_argument("--cells", default=None, help="CTXxQUERY,... (default: MemOS's nine)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--pool-mb", type=int, default=2048)
    p.add_argument(
        "--path",
        choices=("fast", "generic"),
        default="fast",
        help="fast: the engine's own layers where the model takes them (the server's default); generic: HF's",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="the fast path's element-wise functions under torch.compile (serving/engine/models/compile.py)",
    )
    p.add_argument("--compile-cache", default=None, help="inductor's on-disk cache for --compile")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    env = env_info(args.device)  # the load average at the start
    if args.random_preset:
        from benchmarks.ttft.random_models import random_handle

        handle = random_handle(args.random_preset, args.device, args.dtype)
    else:
        from kvmem.models import load_model

        handle = load_model(args.model, device=args.device, dtype=args.dtype)
    cells = (
        [tuple(int(x) for x in c.split("x")) for c in args.cells.split(",")]
        if args.cells
        else [(c, q) for c in MEMOS_CTX for q in MEMOS_QUERY]
    )
    if args.path == "fast":
        choice = models.enable(handle.model, compile=args.compile, cache_dir=args.compile_cache)
    else:
        choice = models.Choice("generic", "--path generic")
    print(f"engine layers {choice.path}, built in {choice.build_s:.1f} s", flush=True)
    pool = PagePool(PoolShape.of_model(handle.model), args.pool_mb << 20, device=handle.device)
    result = {
        "env": env,
        "model": handle.model_id,
        "dtype": str(next(handle.model.parameters()).dtype),
        "path": choice.path,
        "path_reason": choice.reason,
        "compiled": choice.compiled,
        "build_s": choice.build_s,  # the fast layers' build (and with --compile, the compile or cache load)
        "reps": args.reps,
        "cells": [],
    }
    rows = result["cells"]
    with torch.inference_mode():
        for c, q in cells:
            rows.append(run_cell(handle, pool, c, q, args.reps))
            r = rows[-1]
            print(f"cell {c}x{q}: static {r['static_ms']:.2f} ms, full {r['full_ms']:.2f} ms", flush=True)
            # rewritten after every cell: a run cut short by its caller's limit keeps what it measured
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=1))
    print_table(
        [
            "ctx",
            "query",
            "eager ms",
            "static ms",
            "x",
            "full ms",
            "cut %",
            "MemOS %",
            "/floor",
            "replays",
            "same",
        ],
        [
            [
                r["ctx_tokens"],
                r["query_tokens"],
                r["eager_ms"],
                r["static_ms"],
                r["speedup"],
                r[f"{r['full_best']}_ms"],
                r["reduction_pct"],
                r["memos_speedup_pct"],
                r["floor_static"]["measured_over_floor"],
                r["replayed"],
                r["tokens_identical"],
            ]
            for r in rows
        ],  # fmt: skip
    )
    write_outputs(result, args.out)
    return result


if __name__ == "__main__":
    main()

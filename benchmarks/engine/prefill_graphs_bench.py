"""A KV-injected request's query-only forward through the engine, eager against static prefill
(serving/engine/prefill_graphs.py: CUDA graphs on a GPU, the same padded static chunk run eagerly on CPU), at
MemOS's nine cells (memory tokens x query tokens, benchmarks/ttft/memos_grid.py).

Per cell: a block of the cell's memory tokens built once (build_item, off the clock); then, per arm, --reps
requests each admitted over the block and prefilled in one chunk (runner.step, the engine's own step), timed
from the step's start to its token on the host (the first rep of each arm is a warm-up: the graph's capture).
Reported: median and p90 step ms per arm, the static arm's bucket (query tokens, context) and whether graphs
replayed, and whether the first tokens of the two arms are identical (they must be in float32; in bfloat16
the padded matmuls may round differently and a near-tie can flip: stated, not asserted).
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
import time

import torch

from benchmarks.common import env_info, median, p90, print_table, write_outputs
from benchmarks.ttft.memos_grid import MEMOS_CTX, MEMOS_QUERY, memories_for, query_for
from kvmem.kv import PromptLayout, Sampling, build_item
from serving.engine import runner
from serving.engine.pages import PagePool, PoolShape
from serving.engine.prefill_graphs import PrefillGraphs
from serving.engine.sequence import admit


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def one_request(model, pool, ids, item) -> tuple[float, int]:
    """Admit a request over `item`, prefill its query in one step; (seconds, its first token)."""
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
    for arm in ("eager", "static"):
        pool.prefill_graphs = PrefillGraphs(model, pool) if arm == "static" else None
        times, tokens = [], []
        for _ in range(reps + 1):
            s, token = one_request(model, pool, ids, item)
            times.append(s)
            tokens.append(token)
        row[f"{arm}_ms"] = median(times[1:]) * 1e3
        row[f"{arm}_p90_ms"] = p90(times[1:]) * 1e3
        row[f"{arm}_token"] = tokens[-1]
        if arm == "static":
            g = pool.prefill_graphs
            row["bucket"] = sorted(g.buckets)
            row["replayed"] = g.replays
            row["failed"] = sorted(g.failed)
    pool.prefill_graphs = None
    row["tokens_identical"] = row["eager_token"] == row["static_token"]
    row["speedup"] = row["eager_ms"] / row["static_ms"]
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
    pool = PagePool(PoolShape.of_model(handle.model), args.pool_mb << 20, device=handle.device)
    with torch.inference_mode():
        rows = [run_cell(handle, pool, c, q, args.reps) for c, q in cells]
    print_table(
        ["ctx", "query", "eager ms", "static ms", "x", "bucket", "replays", "same token"],
        [
            [
                r["ctx_tokens"],
                r["query_tokens"],
                r["eager_ms"],
                r["static_ms"],
                r["speedup"],
                r["bucket"],
                r["replayed"],
                r["tokens_identical"],
            ]
            for r in rows
        ],  # fmt: skip
    )
    result = {
        "env": env,
        "model": handle.model_id,
        "dtype": str(next(handle.model.parameters()).dtype),
        "reps": args.reps,
        "cells": rows,
    }
    write_outputs(result, args.out)
    return result


if __name__ == "__main__":
    main()

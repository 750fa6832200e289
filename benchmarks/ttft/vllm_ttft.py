"""TTFT on the vLLM backend: a user's block injected from its KV item vs resident in vLLM's prefix cache vs a
cold prefill, over the same grid and prompts as ttft_grid.

Per cell (memory context size x query size), through `VllmBackend.stream` (the server's path, one new token):
- cold: nothing cached, under a salt nothing else used (the whole prompt prefilled by vLLM);
- injected: vLLM's prefix cache emptied, the block loaded from its stored item by our connector;
- resident: the block's whole KV blocks in vLLM's prefix cache (prewarmed), the tail loaded by the connector.
TTFT is the engine thread's time from adding the request to its first output (median after warm-up), and
`identical` says whether the greedy tokens of every arm equal the cold arm's. `--check` makes it a test: it
exits 1 unless every cell is identical and the injected arm reused exactly the block's tokens (the connector
loaded them all); the GPU check the README gives is

    python -m benchmarks.ttft.vllm_ttft --quick --check --block-size 16 --out out/vllm_ttft_gpu.json

    python -m benchmarks.ttft.ttft_grid --backend vllm --quick --out out/vllm_ttft_quick.json
    python -m benchmarks.ttft.vllm_ttft --quick --out out/vllm_ttft_quick.json
    python -m benchmarks.ttft.vllm_ttft --out benchmarks/results/cpu/vllm_ttft.json    # all 9 cells, vs MemOS
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.common import OthersCpu, env_info, median, p90, print_table, write_outputs
from benchmarks.ttft.memos_grid import (
    MEMOS_CTX,
    MEMOS_QUERY,
    MEMOS_QWEN3_8B,
    QUICK_CTX,
    QUICK_QUERY,
    memories_for,
    query_for,
)
from serving.backends.base import GenerationRequest, SamplingParams, TokenDelta

ARMS = ("cold", "injected", "resident")


@dataclass
class VllmCell:
    model: str
    ctx_target: int
    query_target: int
    ctx_tokens: int  # the block's tokens
    query_tokens: int  # the rest of the prompt
    build_s: float  # the KV item's build (transformers prefill) and its prewarm into vLLM
    cold_ttft_s: float
    injected_ttft_s: float
    resident_ttft_s: float
    cold_ttft_p90_s: float
    injected_ttft_p90_s: float
    resident_ttft_p90_s: float
    cold_cached_tokens: int
    injected_cached_tokens: int
    resident_cached_tokens: int
    injected_speedup_pct: float
    resident_speedup_pct: float
    identical: bool
    num_new_tokens: int
    memos_speedup_pct: float | None = None  # MemOS's figure for the cell (anchors/memos_kv_ttft.json)
    others_cpu_share: float | None = None  # other processes' share of the cores during the timed reps


async def _first(backend, req) -> tuple[list[int], object]:
    ids, result = [], None
    async for item in backend.stream(req):
        if isinstance(item, TokenDelta):
            ids.extend(item.token_ids)
        else:
            result = item
    return ids, result


def _request(backend, prompt, user: str, item_id: str, arm: str, n: int, counter) -> tuple[list[int], object]:
    """One request of an arm, from an empty prefix cache: cold under a salt never used before, injected from the
    item, resident after a prewarm of the block alone (so only the block's KV blocks are in vLLM's cache)."""
    backend.reset_prefix_cache()
    if arm == "resident":
        backend.warm_block(item_id)
    who = f"{user}-cold-{next(counter)}" if arm == "cold" else user
    req = GenerationRequest(
        f"bench-{next(counter)}",
        who,
        prompt,
        None if arm == "cold" else item_id,
        SamplingParams(max_new_tokens=n, temperature=0.0),
    )
    return asyncio.run(_first(backend, req))


def run_grid(
    backend, ctx_sizes, query_sizes, *, reps: int, warmup: int, new_tokens: int, log, on_cell=None
) -> list[VllmCell]:
    """`on_cell(cells so far)` after each cell (main saves them, so a long run interrupted keeps its cells)."""
    counter = itertools.count()
    cells = []
    for ctx, qry in itertools.product(ctx_sizes, query_sizes):
        memories = memories_for(backend.layout, ctx, seed=ctx)
        messages = query_for(backend.layout, memories, qry, seed=qry)
        user = f"bench-{ctx}-{qry}"
        started = time.perf_counter()
        built = backend.build_block(user, memories)
        build_s = time.perf_counter() - started
        prompt = backend.layout_prompt(memories, [], messages, built.token_ids)

        tokens = {
            arm: _request(backend, prompt, user, built.item_id, arm, new_tokens, counter)[0] for arm in ARMS
        }
        times: dict[str, list[float]] = {arm: [] for arm in ARMS}
        cached: dict[str, int] = {}
        meter = OthersCpu()
        meter.start()
        for rep in range(warmup + reps):
            for arm in ARMS:  # interleaved, so drift in machine load hits every arm alike
                _, result = _request(backend, prompt, user, built.item_id, arm, 1, counter)
                cached[arm] = result.cached_tokens
                if rep >= warmup:
                    times[arm].append(result.ttft_s)
        med = {arm: median(times[arm]) for arm in ARMS}
        cell = VllmCell(
            model=backend.model_id,
            ctx_target=ctx,
            query_target=qry,
            ctx_tokens=prompt.block_len,
            query_tokens=len(prompt.ids) - prompt.block_len,
            build_s=round(build_s, 4),
            cold_ttft_s=round(med["cold"], 4),
            injected_ttft_s=round(med["injected"], 4),
            resident_ttft_s=round(med["resident"], 4),
            cold_ttft_p90_s=round(p90(times["cold"]), 4),
            injected_ttft_p90_s=round(p90(times["injected"]), 4),
            resident_ttft_p90_s=round(p90(times["resident"]), 4),
            cold_cached_tokens=cached["cold"],
            injected_cached_tokens=cached["injected"],
            resident_cached_tokens=cached["resident"],
            injected_speedup_pct=round(100 * (1 - med["injected"] / med["cold"]), 1),
            resident_speedup_pct=round(100 * (1 - med["resident"] / med["cold"]), 1),
            identical=tokens["injected"] == tokens["cold"] == tokens["resident"],
            num_new_tokens=new_tokens,
            memos_speedup_pct=MEMOS_QWEN3_8B.get((ctx, qry)),
            others_cpu_share=meter.share(),
        )
        log(f"cell ctx={ctx} query={qry}: {cell}")
        cells.append(cell)
        if on_cell is not None:
            on_cell(cells)
    return cells


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.ttft.vllm_ttft", description=__doc__.splitlines()[0]
    )
    p.add_argument("--quick", action="store_true", help="ctx 583/2773 x query 167/303, 1 rep")
    p.add_argument("--model", default=None, help="local safetensors dir (default: SmolLM2-135M, provisioned)")
    p.add_argument("--ctx", type=int, nargs="+", default=None, help="context sizes in tokens")
    p.add_argument("--query", type=int, nargs="+", default=None, help="query sizes in tokens")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--new-tokens", type=int, default=16, help="greedy tokens compared for 'identical'")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16", "float16"),
        help="vLLM's dtype (on a GPU: float32 runs Triton attention, bf16/fp16 FlashAttention or FlashInfer; "
        "the stored items are fp32, so only float32 promises identical tokens)",
    )
    p.add_argument(
        "--block-size", type=int, default=None, help="vLLM's KV block size (default: the platform's)"
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="exit 1 unless every cell is identical to cold and the injected arm reused the whole block",
    )
    p.add_argument("--out", required=True, help="JSON output path")
    return p.parse_args(argv)


def _result(env: dict, cells: list[VllmCell], complete: bool) -> dict:
    return {
        "env": {**env, "load_avg_1m_at_end": os.getloadavg()[0]},
        "cells": [asdict(c) for c in cells],
        "complete": complete,  # False: saved after a cell, the run still going (or cut short)
        "summary": {
            "all_identical": all(c.identical for c in cells),
            "all_injected_whole_block": all(c.injected_cached_tokens == c.ctx_tokens for c in cells),
            "cells_meeting_memos": sum(
                c.memos_speedup_pct is not None and c.injected_speedup_pct >= c.memos_speedup_pct
                for c in cells
            ),
            "cells_with_memos": sum(c.memos_speedup_pct is not None for c in cells),
        },
    }


def main(argv: list[str] | None = None) -> dict:
    import torch
    import vllm

    from serving.backends.vllm.backend import VllmBackend, VllmBackendConfig
    from serving.backends.vllm.connector import worker_backends

    args = parse_args(argv)
    ctx = tuple(args.ctx or (QUICK_CTX if args.quick else MEMOS_CTX))
    qry = tuple(args.query or (QUICK_QUERY if args.quick else MEMOS_QUERY))
    reps = args.reps or (1 if args.quick else 3)
    env = {
        **env_info("cuda" if torch.cuda.is_available() else "cpu"),
        "backend": "vllm",
        "vllm": vllm.__version__,
        "dtype": args.dtype,
        "reps": reps,
        "warmup": args.warmup,
        "ttft": "engine thread: request added -> first output",
        "load_avg_1m_at_start": os.getloadavg()[0],
    }
    with tempfile.TemporaryDirectory() as data_dir:
        config = VllmBackendConfig(
            model=args.model, data_dir=data_dir, dtype=args.dtype, block_size=args.block_size
        )
        backend = VllmBackend(config)
        backend.load()
        env["model"] = backend.model_id
        cache_config = backend._engine.engine.vllm_config.cache_config
        env["block_size"] = cache_config.block_size
        env["kv_cache_layout"] = cache_config.kv_cache_layout  # vLLM's resolved layout (LBNHC, ...)
        env["attention_backends"] = list(worker_backends())  # what the connector writes (CPU_ATTN, ...)
        try:
            cells = run_grid(
                backend,
                ctx,
                qry,
                reps=reps,
                warmup=args.warmup,
                new_tokens=args.new_tokens,
                log=lambda s: print(s, file=sys.stderr),
                on_cell=lambda done: Path(args.out).write_text(
                    json.dumps(_result(env, done, False), indent=1)
                ),
            )
        finally:
            asyncio.run(backend.aclose())
    print_table(
        [
            "Ctx",
            "CtxTok",
            "Qry",
            "QryTok",
            "Build (s)",
            "Cold (s)",
            "Injected (s)",
            "Resident (s)",
            "Inj (%)",
            "Res (%)",
            "Cached inj/res",
            "Identical",
            "MemOS (%)",
        ],
        [
            [
                c.ctx_target,
                c.ctx_tokens,
                c.query_target,
                c.query_tokens,
                c.build_s,
                c.cold_ttft_s,
                c.injected_ttft_s,
                c.resident_ttft_s,
                c.injected_speedup_pct,
                c.resident_speedup_pct,
                f"{c.injected_cached_tokens}/{c.resident_cached_tokens}",
                c.identical,
                c.memos_speedup_pct,
            ]
            for c in cells
        ],
    )
    result = _result(env, cells, True)
    write_outputs(result, args.out)
    if args.check:
        ok = result["summary"]["all_identical"] and result["summary"]["all_injected_whole_block"]
        print(
            f"check {'passed' if ok else 'FAILED'}: {sum(c.identical for c in cells)}/{len(cells)} cells identical "
            f"to cold, {sum(c.injected_cached_tokens == c.ctx_tokens for c in cells)}/{len(cells)} injected the "
            f"whole block ({', '.join(env['attention_backends'])}, {env['dtype']}, block size {env['block_size']})",
            file=sys.stderr,
        )
        if not ok:
            raise SystemExit(1)
    return result


if __name__ == "__main__":
    main()

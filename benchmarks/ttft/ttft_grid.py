"""TTFT grid: KV injection vs prompt injection (full prefill of the same ids), MemOS's evaluation grid.

Per cell (memory context size x query size): the one-off build time of the KV item, TTFT of each arm
(median after warm-up), speedup %, whether greedy outputs are identical (ours vs transformers' generate
over the full prompt), and the ideal bound: prefilling only the query over a cache already in place.
The grid's cells and prompts are memos_grid.py's, the random-weight models random_models.py's, the vLLM
backend's arms vllm_ttft.py's (`--backend vllm` hands the run to it).

    python -m benchmarks.ttft.ttft_grid --quick --out out/ttft_quick.json
    python -m benchmarks.ttft.ttft_grid --model M --device cuda --dtype bfloat16 --out out/ttft_gpu.json
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from dataclasses import asdict, dataclass

import torch
from transformers import DynamicCache

from benchmarks.common import (
    env_info,
    median,
    p90,
    print_table,
    run_when_quiet,
    sync,
    timed,
    write_outputs,
)
from benchmarks.gpu import floor as floors
from benchmarks.ttft.memos_grid import MEMOS_ANCHOR as MEMOS_ANCHOR  # the grid lives there; re-exported
from benchmarks.ttft.memos_grid import (
    MEMOS_CTX,
    MEMOS_QUERY,
    MEMOS_QWEN3_8B,
    QUICK_CTX,
    QUICK_QUERY,
    memories_for,
    query_for,
)
from benchmarks.ttft.random_models import random_handle
from benchmarks.ttft.ttft_plot import plot
from kvmem.kv import (
    GenerationStats,
    KVStoreConfig,
    PromptLayout,
    Sampling,
    TieredKVStore,
    build_item,
    generate,
)
from kvmem.models import compiled


@dataclass
class Cell:
    model: str
    ctx_tokens: int
    query_tokens: int
    build_s: float
    kv_ttft_s: float
    direct_ttft_s: float
    ideal_ttft_s: float
    speedup_pct: float
    identical: bool
    overhead_pct: float
    kv_ttft_p90_s: float
    direct_ttft_p90_s: float
    memos_speedup_pct: float | None
    ctx_target: int
    query_target: int
    num_new_tokens: int
    others_cpu_share: float | None  # other processes' share of the cores during the timed reps
    attempts: int  # timed-rep rounds run (more than 1: others' load spoiled the earlier ones)
    waited_quiet_s: float
    # benchmarks/gpu/floor.py: the query-only forward over the block (the KV path's and the ideal bound's
    # floor, with kv_ttft_s and ideal_ttft_s over it) and the full prefill's (direct_ttft_s over it)
    floor_kv: dict | None = None
    floor_ideal: dict | None = None
    floor_direct: dict | None = None


def ideal_first_token(model, item, remainder: list[int], device: str) -> tuple[float, int]:
    """Prefill only the remainder over a DynamicCache that already holds the block (built off the clock)."""
    data = [
        (item.kv[i, 0].unsqueeze(0).clone(), item.kv[i, 1].unsqueeze(0).clone())
        for i in range(item.kv.shape[0])
    ]
    cache = DynamicCache(ddp_cache_data=data)
    ids = torch.tensor([remainder], device=device)
    pos = torch.arange(item.num_tokens, item.num_tokens + len(remainder), device=device)

    def step() -> int:
        with torch.inference_mode():
            out = model(
                input_ids=ids, past_key_values=cache, use_cache=True, cache_position=pos, logits_to_keep=1
            )
            return int(torch.argmax(out.logits[0, -1]).item())

    return timed(step, device)


def first_token_s(model, ids, item, store, device: str) -> float:
    """Our request path up to the first token: fetch the item from the store (when given), inject, prefill."""
    stats = GenerationStats()

    def run() -> None:
        it = store.get(item.item_id) if item is not None else None
        next(iter(generate(model, ids, item=it, sampling=Sampling(max_new_tokens=1), stats=stats)))

    return timed(run, device)[0]


def reference_tokens(model, ids, n: int, device: str) -> list[int]:
    out = model.generate(
        torch.tensor([ids], device=device),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(ids) :].tolist()


def run_grid(
    handle,
    ctx_sizes,
    query_sizes,
    *,
    reps: int,
    warmup: int,
    new_tokens: int,
    device: str,
    model_name: str,
    compile_model: bool = False,
    max_others_share: float | None = None,
    attempts: int = 3,
    quiet_wait_s: float = 600.0,
    log=print,
) -> list[Cell]:
    """With `compile_model`, every timed arm (ours, the ideal bound, full prefill) runs the compiled
    model; 'identical' still compares against transformers' eager `generate` over the full prompt.
    With `max_others_share`, a cell's timed reps wait for a quiet machine and run again (up to `attempts`)
    while other processes took more than that share of the cores (see `common.run_when_quiet`)."""
    layout = PromptLayout(handle.tokenizer)
    model = compiled(handle.model) if compile_model else handle.model
    shape, card = floors.shape_of(handle.model), floors.device_name(device)
    cells: list[Cell] = []
    with tempfile.TemporaryDirectory() as tmp:
        store = TieredKVStore(
            KVStoreConfig(directory=tmp, device=device, device_bytes=None), handle.fingerprint
        )
        for ctx in ctx_sizes:
            memories = memories_for(layout, ctx, seed=ctx)
            block = layout.block_ids(memories)
            build_s, item = timed(lambda b=block: build_item(handle, b, user_id="bench"), device)
            store.put(item, persist=False)
            for qry in query_sizes:
                prompt = layout.prompt(memories, [], query_for(layout, memories, qry, seed=qry))
                ids = list(prompt.ids)
                remainder = ids[len(block) :]
                ref = reference_tokens(handle.model, ids, new_tokens, device)  # also warms the direct path
                ours = list(
                    generate(
                        model,
                        ids,
                        item=store.get(item.item_id),
                        sampling=Sampling(max_new_tokens=new_tokens),
                    )
                )
                for _ in range(warmup):
                    first_token_s(model, ids, item, store, device)
                    ideal_first_token(model, item, remainder, device)
                    first_token_s(model, ids, None, store, device)

                def timed_reps(ids=ids, remainder=remainder, item=item):
                    kv: list[float] = []
                    ideal: list[float] = []
                    direct: list[float] = []
                    # the arms take turns, so another job's burst of load hits all three
                    for _ in range(reps):
                        kv.append(first_token_s(model, ids, item, store, device))
                        ideal.append(ideal_first_token(model, item, remainder, device)[0])
                        direct.append(first_token_s(model, ids, None, store, device))
                    return kv, ideal, direct

                run = run_when_quiet(
                    timed_reps, max_share=max_others_share, attempts=attempts, max_wait_s=quiet_wait_s
                )
                kv, ideal, direct = run.result
                kv_s, direct_s, ideal_s = median(kv), median(direct), median(ideal)
                query_only = floors.step_cost(shape, [len(block)], [len(remainder)])
                cell = Cell(
                    model=model_name,
                    ctx_tokens=len(block),
                    query_tokens=len(remainder),
                    build_s=build_s,
                    kv_ttft_s=kv_s,
                    direct_ttft_s=direct_s,
                    ideal_ttft_s=ideal_s,
                    speedup_pct=100.0 * (1.0 - kv_s / direct_s),
                    identical=ours == ref,
                    overhead_pct=100.0 * (kv_s - ideal_s) / kv_s,
                    kv_ttft_p90_s=p90(kv),
                    direct_ttft_p90_s=p90(direct),
                    memos_speedup_pct=MEMOS_QWEN3_8B.get((ctx, qry)),
                    ctx_target=ctx,
                    query_target=qry,
                    num_new_tokens=new_tokens,
                    others_cpu_share=run.others_share,
                    attempts=run.attempts,
                    waited_quiet_s=run.waited_s,
                    floor_kv=floors.floor(*query_only, card, measured_s=kv_s),
                    floor_ideal=floors.floor(*query_only, card, measured_s=ideal_s),
                    floor_direct=floors.floor(*floors.step_cost(shape, [0], [len(ids)]), card, direct_s),
                )
                cells.append(cell)
                log(
                    f"# ctx {cell.ctx_tokens} qry {cell.query_tokens}: kv {kv_s:.4f}s direct {direct_s:.4f}s "
                    f"ideal {ideal_s:.4f}s speedup {cell.speedup_pct:.1f}% identical {cell.identical} "
                    f"others' cpu {cell.others_cpu_share} attempts {cell.attempts}"
                )
            store.remove(item.item_id)
            del item
            sync(device)
    return cells


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.ttft.ttft_grid", description=__doc__.splitlines()[0]
    )
    p.add_argument(
        "--quick", action="store_true", help="ctx 583/2773 x query 167/303, 1 rep (< 5 min on CPU)"
    )
    p.add_argument("--model", default=None, help="alias, local dir, .gguf or HF id (default: SmolLM2-135M)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="float32 (CPU default) | bfloat16 (CUDA default) | float16")
    p.add_argument("--ctx", type=int, nargs="+", default=None, help="context sizes in tokens")
    p.add_argument("--query", type=int, nargs="+", default=None, help="query sizes in tokens")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--new-tokens", type=int, default=16, help="greedy tokens compared for 'identical'")
    p.add_argument(
        "--random-preset",
        default=None,
        help="a model shape with seeded random weights: qwen3-8b, smollm2-135m",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="time every arm on the torch.compile'd model (for GPUs, where eager short prefills are "
        "launch-bound); the warm-up compiles",
    )
    p.add_argument(
        "--max-others-share",
        type=float,
        default=None,
        help="on a shared machine: before each cell's timed reps wait for other processes to use less than "
        "this share of the cores, and time the reps again (up to --attempts) when they took more",
    )
    p.add_argument("--attempts", type=int, default=3)
    p.add_argument("--quiet-wait-s", type=float, default=600.0, help="longest wait for a quiet machine")
    p.add_argument("--out", required=True, help="JSON output path (a PNG is written beside it)")
    p.add_argument(
        "--backend",
        choices=("transformers", "vllm"),
        default="transformers",
        help="vllm: the vLLM backend's arms instead (injected / resident / cold; benchmarks.ttft.vllm_ttft)",
    )
    return p.parse_args(argv)


def _vllm_argv(args: argparse.Namespace) -> list[str]:
    """The same grid for benchmarks.ttft.vllm_ttft (CPU fp32 eager only, a safetensors model)."""
    if args.device != "cpu" or args.compile or args.random_preset or args.dtype not in (None, "float32"):
        raise SystemExit("ttft_grid --backend vllm: only --device cpu, fp32, no --compile or --random-preset")
    argv = ["--out", args.out, "--warmup", str(args.warmup), "--new-tokens", str(args.new_tokens)]
    argv += ["--quick"] if args.quick else []
    argv += ["--model", args.model] if args.model else []
    argv += ["--reps", str(args.reps)] if args.reps else []
    argv += ["--ctx", *map(str, args.ctx)] if args.ctx else []
    argv += ["--query", *map(str, args.query)] if args.query else []
    return argv


def main(argv: list[str] | None = None, handle=None) -> dict:
    args = parse_args(argv)
    if args.backend == "vllm":
        from benchmarks.ttft import vllm_ttft

        return vllm_ttft.main(_vllm_argv(args))
    ctx = tuple(args.ctx or (QUICK_CTX if args.quick else MEMOS_CTX))
    qry = tuple(args.query or (QUICK_QUERY if args.quick else MEMOS_QUERY))
    reps = args.reps or (1 if args.quick else 3)
    if handle is None and args.random_preset:
        handle = random_handle(args.random_preset, args.device, args.dtype)
    elif handle is None:
        from kvmem.models import load_model

        handle = load_model(args.model, device=args.device, dtype=args.dtype)
    torch.manual_seed(0)
    loadavg_start = list(os.getloadavg())
    name = handle.model_id.rstrip("/").split("/")[-1]
    cells = run_grid(
        handle,
        ctx,
        qry,
        reps=reps,
        warmup=args.warmup,
        new_tokens=args.new_tokens,
        device=args.device,
        model_name=name,
        compile_model=args.compile,
        max_others_share=args.max_others_share,
        attempts=args.attempts,
        quiet_wait_s=args.quiet_wait_s,
        log=lambda s: print(s, file=sys.stderr),
    )
    print_table(
        [
            "Model",
            "Ctx",
            "CtxTok",
            "Qry",
            "QryTok",
            "Build (s)",
            "KV TTFT (s)",
            "Dir TTFT (s)",
            "Speedup (%)",
            "Ideal (s)",
            "Overhead (%)",
            "Identical",
            "MemOS (%)",
            "Others CPU (%)",
            "Attempts",
        ],
        [
            [
                c.model,
                c.ctx_target,
                c.ctx_tokens,
                c.query_target,
                c.query_tokens,
                c.build_s,
                c.kv_ttft_s,
                c.direct_ttft_s,
                round(c.speedup_pct, 1),
                c.ideal_ttft_s,
                round(c.overhead_pct, 1),
                c.identical,
                c.memos_speedup_pct,
                None if c.others_cpu_share is None else round(100 * c.others_cpu_share, 1),
                c.attempts,
            ]
            for c in cells
        ],
    )
    png = plot(cells, args.out.rsplit(".", 1)[0] + ".png") if cells else None
    result = {
        "env": {
            **env_info(args.device),
            "model": handle.model_id,
            "dtype": str(handle.dtype),
            "reps": reps,
            "warmup": args.warmup,
            "compiled": args.compile,
            "loadavg_start": loadavg_start,
            "max_others_share": args.max_others_share,
            "png": png,
        },
        "cells": [asdict(c) for c in cells],
    }
    write_outputs(result, args.out)
    return result


if __name__ == "__main__":
    main()

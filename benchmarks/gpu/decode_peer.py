"""Decode on Qwen3-8B's shape (seeded random bf16 weights) through the engine and through transformers' own
continuous batching (the peer), in one process on one card, with each figure's floor (issue 43, item 5).

For each request count R (`--rows`, default 1 8 32 64): R prompts of `--prompt` + 3k tokens (different lengths,
random ids; the same ids for both), `--new-tokens` greedy tokens each, no end token.
- engine: the engine's own steps (serving/engine/runner.step over its page pool, the fast layers where the model
  takes them, decode steps replayed as CUDA graphs on a GPU as the server does: serving/engine/graphs.py; a
  row count past the largest graph bucket runs eagerly). A warm-up run (3 tokens, the graphs captured), then
  the timed run: its wall time (prefill included) gives tokens/s end to end; each decode-only step is timed
  too (`step_ms`: the median; `decode_tokens_per_s` = R / step).
- peer: `model.generate_batch` (transformers' continuous batching) with attention "paged|sdpa" passed
  explicitly at load (never a hub kernel: the lent machine has no network; `auto_switch_to_flash` off, so it
  stays on SDPA), CUDA graphs on (use_cuda_graph=True) on a GPU. Its warm-up (graph capture) happens before
  its requests are added; tokens/s end to end is R x new tokens over the time from the requests' creation to
  their last token, and `step_ms` the median gap between a request's consecutive tokens.
The peer runs first, on the model as loaded; the engine's fast layers are enabled after it.
Every case has a `floor` (benchmarks/gpu/floor.py): the decode step at mid-reply context, its bytes over the
card's bandwidth and FLOPs over its bf16 peak, and step_ms over it. The JSON is rewritten after every case, so a
run cut short keeps what it measured. `--tiny`: a tiny Qwen3 shape (the script's smoke on CPU, not figures).

    python -m benchmarks.gpu.decode_peer --device cuda --out benchmarks/results/gpu/<card>/decode_qwen3_8b.json
    python -m benchmarks.gpu.decode_peer --tiny --device cpu --rows 1 3 --new-tokens 4   # smoke
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import env_info, median, print_table, write_outputs
from benchmarks.gpu import floor as floors

QWEN3_VOCAB = 151_936  # Qwen3-8B's vocabulary (its output head is 1.2 GB of the 16.4 in bf16)
TINY = dict(
    model_type="qwen3",
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)


def build_model(tiny: bool, device: str, dtype: torch.dtype):
    """Seeded random weights of Qwen3-8B's shape (or TINY), attention "paged|sdpa" requested at load."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from benchmarks.ttft.random_models import RANDOM_PRESETS

    spec = dict(TINY) if tiny else {**RANDOM_PRESETS["qwen3-8b"], "vocab_size": QWEN3_VOCAB}
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="paged|sdpa")
    return model.eval()


def prompts(rows: int, prompt: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(rows)
    return [torch.randint(10, vocab, (prompt + 3 * k,), generator=g).tolist() for k in range(rows)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def engine_run(model, pool, inputs: list[list[int]], new_tokens: int) -> dict:
    """Every prompt through the engine's steps to `new_tokens` tokens: wall time, each decode-only step's time."""
    from kvmem.kv import Sampling
    from serving.engine import runner
    from serving.engine.sequence import admit

    device = next(model.parameters()).device
    seqs = []
    for ids in inputs:
        sampling = Sampling(max_new_tokens=new_tokens, temperature=0.0)  # greedy, no end token
        *_, seq = admit(pool, model, ids, item=None, max_new_tokens=new_tokens, wait_s=0, sampling=sampling)
        seqs.append(seq)
    steps, tokens = [], 0
    try:
        _sync(device)
        t0 = time.perf_counter()
        while any(not s.finished for s in seqs):
            prefills = [s for s in seqs if s.prefilling]
            decodes = [s for s in seqs if s.decoding and not s.finished]
            for seq in prefills + decodes:  # a page for every position the step writes (as the batcher does)
                if not seq.table.grow(seq.position + seq.step_tokens()):
                    raise RuntimeError("the page pool is too small for this run: give a larger --pool-mb")
            t = time.perf_counter()
            out = runner.step(model, pool, prefills, decodes)
            _sync(device)
            if not prefills:
                steps.append(time.perf_counter() - t)
            tokens += sum(1 for x in out if isinstance(x, int))
        wall = time.perf_counter() - t0
        if tokens != len(inputs) * new_tokens:
            raise RuntimeError(f"the engine made {tokens} tokens, not {len(inputs)} x {new_tokens}")
        replies = [list(s.stats.token_ids) for s in seqs]
    finally:
        for s in seqs:
            s.release()
    return {"wall_s": wall, "tokens": tokens, "decode_steps_s": steps, "replies": replies}


def peer_run(model, inputs: list[list[int]], new_tokens: int, device: torch.device, page_size: int) -> dict:
    """transformers' continuous batching on the same prompts (see the module docstring)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    need = sum(len(ids) + new_tokens for ids in inputs)
    cb = ContinuousBatchingConfig(
        page_size=page_size,
        num_blocks=need // page_size + 2 * len(inputs) + 8,
        max_batch_tokens=2048,
        use_cuda_graph=device.type == "cuda",
        auto_switch_to_flash=False,  # SDPA as asked: a flash kernel would come from the hub
        allow_block_sharing=False,
    )
    gen = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    t0 = time.perf_counter()
    out = model.generate_batch(
        inputs,
        generation_config=gen,
        continuous_batching_config=cb,
        record_timestamps=True,
        progress_bar=False,
    )
    wall = time.perf_counter() - t0
    results = list(out.values())
    if len(results) != len(inputs) or any(r.error for r in results):
        raise RuntimeError(
            f"the peer failed: {[r.error for r in results if r.error][:1] or 'requests missing'}"
        )
    tokens = sum(len(r.generated_tokens) for r in results)
    start = min(r.created_time for r in results)
    end = max(r.timestamps[-1] for r in results)
    gaps = [b - a for r in results for a, b in zip(r.timestamps, r.timestamps[1:], strict=False)]
    replies = [list(r.generated_tokens) for r in results]
    return {
        "wall_with_warmup_s": wall,
        "run_s": end - start,
        "tokens": tokens,
        "token_gaps_s": gaps,
        "replies": replies,
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu.decode_peer", description=__doc__.splitlines()[0]
    )
    p.add_argument("--tiny", action="store_true", help="a tiny Qwen3 shape: the script's smoke, not figures")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="default bfloat16 on a GPU, float32 on CPU")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64], help="request counts")
    p.add_argument(
        "--prompt", type=int, default=256, help="prompt tokens of the first request (+3 each next)"
    )
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--pool-mb", type=int, default=None, help="the engine's page pool (default: what R needs)")
    p.add_argument("--no-peer", action="store_true")
    p.add_argument(
        "--compile",
        action="store_true",
        help="the engine's element-wise functions under torch.compile (serving/engine/models/compile.py)",
    )
    p.add_argument("--compile-cache", default=None, help="inductor's on-disk cache for --compile")
    p.add_argument("--no-engine", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if min(args.rows) < 1 or args.new_tokens < 2 or args.prompt < 1:
        p.error("--rows and --prompt must be >= 1, --new-tokens >= 2")
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    env = env_info(args.device)  # load average taken here, at the start
    name = floors.device_name(device)
    t_start = time.perf_counter()
    model = build_model(args.tiny, args.device, dtype)
    shape = floors.shape_of(model)
    vocab = model.config.vocab_size
    result = {
        "benchmark": "decode_peer",
        "env": env,
        "args": vars(args),
        "device_name": name,
        "model": "tiny qwen3 shape (smoke)" if args.tiny else "Qwen3-8B shape, random weights (seed 0)",
        "dtype": str(dtype),
        "weight_bytes": shape.weight_bytes,
        "attn_implementation_requested": "paged|sdpa",
        "model_build_s": time.perf_counter() - t_start,
        "cases": [],
    }
    print(
        f"[decode_peer] model built in {result['model_build_s']:.1f} s on {name}", file=sys.stderr, flush=True
    )

    def floor_for(rows: int, step_s: float | None) -> dict:
        contexts = [args.prompt + 3 * k + args.new_tokens // 2 for k in range(rows)]  # mid-reply
        return floors.floor(*floors.step_cost(shape, contexts), name, measured_s=step_s)

    def case(kind: str, rows: int, fields: dict) -> None:
        result["cases"].append({"kind": kind, "rows": rows, **fields})
        result["elapsed_s"] = time.perf_counter() - t_start
        if args.out:  # rewritten after every case: a run cut short keeps what it measured
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=1))
        print(
            f"[decode_peer +{result['elapsed_s']:.0f}s] {kind} {rows} rows done", file=sys.stderr, flush=True
        )

    # the peer runs its own generation thread: not under this thread's inference mode (its tensors must not
    # be inference tensors made here)
    peer_replies = {}
    if not args.no_peer:
        for rows in args.rows:
            inputs = prompts(rows, args.prompt, vocab)
            t = time.perf_counter()
            try:  # a transformers without this API (or a failure in it) is recorded; the engine still runs
                r = peer_run(model, inputs, args.new_tokens, device, page_size=256 if not args.tiny else 16)
            except Exception as exc:  # noqa: BLE001 - recorded in the JSON
                case("peer", rows, {"error": f"{type(exc).__name__}: {exc}"[:2000]})
                continue
            step_s = median(r["token_gaps_s"]) if r["token_gaps_s"] else None
            peer_replies[rows] = r["replies"]
            case(
                "peer",
                rows,
                {
                    "tokens": r["tokens"],
                    "tokens_per_s": r["tokens"] / r["run_s"] if r["run_s"] > 0 else None,
                    "step_ms": None if step_s is None else 1e3 * step_s,
                    "run_s": r["run_s"],
                    "wall_with_warmup_s": r["wall_with_warmup_s"],
                    "case_s": time.perf_counter() - t,
                    "floor": floor_for(rows, step_s),
                },
            )
        gc.collect()  # the peer's manager, cache and graphs
        if device.type == "cuda":
            torch.cuda.empty_cache()
    with torch.inference_mode():
        if not args.no_engine:
            from serving.engine import models
            from serving.engine.graphs import DecodeGraphs
            from serving.engine.pages import PagePool, PoolShape

            choice = models.enable(model, compile=args.compile, cache_dir=args.compile_cache)
            result["engine_path"], result["engine_path_reason"] = choice.path, choice.reason
            # the fast layers' build, with --compile their compile (or cache load) at start: printed and kept
            result["engine_compiled"], result["engine_build_s"] = choice.compiled, choice.build_s
            print(f"[decode_peer] engine layers {choice.path}, built in {choice.build_s:.1f} s", flush=True)
            pool_shape = PoolShape.of_model(model)
            for rows in args.rows:
                inputs = prompts(rows, args.prompt, vocab)
                need = sum(len(ids) + args.new_tokens for ids in inputs) + 64 * rows
                pool_bytes = (args.pool_mb << 20) if args.pool_mb else need * shape.kv_bytes_per_token * 2
                t = time.perf_counter()
                pool = PagePool(pool_shape, pool_bytes, device=device)
                pool.graphs = DecodeGraphs(model, pool) if device.type == "cuda" else None  # as the server
                try:
                    engine_run(
                        model, pool, inputs, 3
                    )  # warm: the graph buckets this run reaches are captured
                    r = engine_run(model, pool, inputs, args.new_tokens)
                except Exception as exc:  # noqa: BLE001 - recorded in the JSON; the next count still runs
                    case("engine", rows, {"error": f"{type(exc).__name__}: {exc}"[:2000]})
                    del pool
                    continue
                step_s = median(r["decode_steps_s"]) if r["decode_steps_s"] else None
                case(
                    "engine",
                    rows,
                    {
                        "tokens": r["tokens"],
                        "tokens_per_s": r["tokens"] / r["wall_s"],
                        "step_ms": None if step_s is None else 1e3 * step_s,
                        "decode_tokens_per_s": None if not step_s else rows / step_s,
                        "run_s": r["wall_s"],
                        "graph_replays": pool.graphs.replays if pool.graphs is not None else None,
                        # greedy replies equal to the peer's (bf16 may differ: its kernels round differently)
                        "replies_equal_to_peer": None
                        if rows not in peer_replies
                        else sum(a == b for a, b in zip(r["replies"], peer_replies[rows], strict=True)),
                        "case_s": time.perf_counter() - t,
                        "floor": floor_for(rows, step_s),
                    },
                )
                del pool
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    by = {(c["kind"], c["rows"]): c for c in result["cases"]}
    table = []
    for rows in args.rows:
        e, q = by.get(("engine", rows), {}), by.get(("peer", rows), {})
        ratio = (
            e["tokens_per_s"] / q["tokens_per_s"] if e.get("tokens_per_s") and q.get("tokens_per_s") else None
        )
        table.append(
            [
                rows,
                e.get("step_ms"),
                e.get("tokens_per_s"),
                (e.get("floor") or {}).get("measured_over_floor"),
                q.get("step_ms"),
                q.get("tokens_per_s"),
                ratio,
            ]
        )
    result["side_by_side"] = [
        dict(
            zip(
                [
                    "rows",
                    "engine_step_ms",
                    "engine_tokens_per_s",
                    "engine_over_floor",
                    "peer_step_ms",
                    "peer_tokens_per_s",
                    "engine_over_peer",
                ],
                row,
                strict=True,
            )
        )
        for row in table
    ]
    result["elapsed_s"] = time.perf_counter() - t_start
    print_table(
        [
            "rows",
            "engine step ms",
            "engine tok/s",
            "engine/floor",
            "peer step ms",
            "peer tok/s",
            "engine/peer",
        ],
        table,
    )
    write_outputs(result, args.out)
    return result


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()

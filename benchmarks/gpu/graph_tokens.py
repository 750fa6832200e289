"""Greedy tokens of decode steps replayed as CUDA graphs against the same steps run eagerly, in float32 and
bfloat16 (issue 42 item 8): the engine's own classes (PagePool, DecodeGraphs warmed as the server warms them
at load, runner.step), one workload, the same steps in both runs.

    python -m benchmarks.gpu.graph_tokens --model MODEL_DIR --out benchmarks/results/gpu/graph_tokens.json
    python -m benchmarks.gpu.graph_tokens --model MODEL_DIR --device cpu --smoke   # the script itself, on CPU

Workload: `--requests` prompts of seeded random token ids, of different lengths (up to `--max-prompt` tokens, so
that steps fall in buckets past 2,048 tokens of context, which the server used to capture lazily), arriving
over the first steps, so that decode steps have changing row counts. The eager run has no graphs; the graphed
run warms its DecodeGraphs at load over every reachable bucket (rows up to `--max-rows`, contexts up to what
one row can hold) and records the time that took.

Per dtype the JSON says how many requests got identical tokens and, for each that did not, where it diverged
and the eager step's log-probability gap between its own token and the graph's there. A dtype passes when
every request is identical or diverges only at a near-tie (gap <= `--tie-nats-fp32` / `--tie-nats-bf16`): the
eager one-token rows round q.k to the model's dtype before the softmax, the graph's fused SDPA does not
(docs/serving.md), and a greedy choice between two tokens that close follows the rounding. The graphed run
must also have replayed graphs (on CUDA) and had no capture fail. Exit status 1 when a dtype fails. On CPU
nothing is captured (the static steps run eagerly): a check of the script, not of graphs.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import torch

from benchmarks.common import env_info, print_table, write_outputs

TOP_LOGPROBS = 5


def prompts(vocab: int, n: int, max_prompt: int, seed: int) -> list[list[int]]:
    """n prompts of random token ids (ids 100.. of the vocabulary), of lengths spread evenly up to max_prompt
    (the k-th of n: about (k + 1) / n of it), in shuffled order."""
    rng = random.Random(seed)
    lengths = [
        max(8, max_prompt * (k + 1) // n - rng.randrange(max(1, max_prompt // (4 * n)))) for k in range(n)
    ]
    rng.shuffle(lengths)
    return [[rng.randrange(100, vocab) for _ in range(length)] for length in lengths]


def run(model, prompts_ids, new_tokens: int, pool_mb: int, graphed: bool, max_rows: int, chunk: int) -> dict:
    """The workload through runner.step; each request's greedy tokens and log-probabilities, and the graphs'
    counts when `graphed`."""
    from kvmem.kv import Sampling
    from serving.engine import runner
    from serving.engine.graphs import DecodeGraphs
    from serving.engine.pages import PagePool, PoolShape
    from serving.engine.sequence import EngineSequence, admit

    device = next(model.parameters()).device
    pool = PagePool(PoolShape.of_model(model), pool_mb << 20, device=device)
    out: dict = {}
    if graphed:
        pool.graphs = DecodeGraphs(model, pool)
        start = time.perf_counter()
        with torch.inference_mode():
            out["buckets_captured_at_load"] = pool.graphs.warm(max_rows=max_rows)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        out["warm_s"] = time.perf_counter() - start
    sampling = Sampling(max_new_tokens=new_tokens, top_logprobs=TOP_LOGPROBS)
    arrive = [k // 2 for k in range(len(prompts_ids))]  # two a step: decode batches of changing sizes
    seqs: list = []
    steps = 0
    while len(seqs) < len(prompts_ids) or any(not s.finished for s in seqs):
        for k, ids in enumerate(prompts_ids):
            if arrive[k] == steps:
                seq = None
                for seq in admit(
                    pool, model, ids, max_new_tokens=new_tokens, sampling=sampling, prefill_chunk_tokens=chunk
                ):
                    if isinstance(seq, EngineSequence):
                        break
                if not isinstance(seq, EngineSequence):
                    raise SystemExit(f"the pool of {pool_mb} MiB has no room for prompt {k}: raise --pool-mb")
                seqs.append(seq)
        prefills = [s for s in seqs if s.prefilling]
        decodes = [s for s in seqs if s.decoding]
        failed = [r for r in runner.step(model, pool, prefills, decodes) if isinstance(r, Exception)]
        if failed:
            raise SystemExit(f"a step failed: {failed[0]}")
        steps += 1
    out["tokens"] = [s.stats.token_ids for s in seqs]
    out["logprobs"] = [s.stats.logprobs for s in seqs]
    for s in seqs:
        s.release()
    if graphed:
        g = pool.graphs
        out.update(
            static_steps=g.steps,
            graph_replays=g.replays,
            buckets=sorted(f"{rows}x{kcap}" for rows, kcap in g.buckets),
            failed_buckets=sorted(f"{rows}x{kcap}" for rows, kcap in g.failed),
        )
    return out


def divergence(eager_tokens, eager_logprobs, graph_tokens) -> dict | None:
    """Where the graph's tokens leave the eager ones, and the eager step's log-probability gap there between its
    token and the graph's (None when the graph's token is not among the eager step's top ones)."""
    at = next((i for i, (a, b) in enumerate(zip(eager_tokens, graph_tokens, strict=False)) if a != b), None)
    if at is None:
        return (
            None
            if len(eager_tokens) == len(graph_tokens)
            else {"at": min(map(len, (eager_tokens, graph_tokens)))}
        )
    lp = eager_logprobs[at]
    top = dict(lp.top)
    other = top.get(graph_tokens[at])
    return {"at": at, "gap_nats": None if other is None else lp.logprob - other}


def check(model_dir: str, dtype: str, args) -> dict:
    from kvmem.models import load_model
    from serving.engine import graphs, runner

    handle = load_model(model_dir, device=args.device, dtype=dtype)
    model = handle.model
    if not runner.supports(model) or not graphs.supports(model):
        raise SystemExit(f"{model_dir}: the engine or its graphs cannot run this model")
    ids = prompts(model.config.get_text_config().vocab_size, args.requests, args.max_prompt, args.seed)
    kw = dict(new_tokens=args.tokens, pool_mb=args.pool_mb, max_rows=args.max_rows, chunk=args.chunk)
    eager = run(model, ids, graphed=False, **kw)
    graph = run(model, ids, graphed=True, **kw)
    tie = args.tie_nats_fp32 if dtype == "float32" else args.tie_nats_bf16
    diverged = []
    for k, (e, lp, g) in enumerate(zip(eager["tokens"], eager["logprobs"], graph["tokens"], strict=True)):
        d = divergence(e, lp, g)
        if d is not None:
            diverged.append({"request": k, "prompt_tokens": len(ids[k]), **d})
    near_ties = all(d.get("gap_nats") is not None and abs(d["gap_nats"]) <= tie for d in diverged)
    replayed = graph["graph_replays"] > 0 or args.device == "cpu"
    result = {
        "dtype": dtype,
        "requests": len(ids),
        "prompt_tokens": [len(p) for p in ids],
        "identical": len(ids) - len(diverged),
        "diverged": diverged,
        "tie_nats": tie,
        "pass": near_ties and replayed and not graph["failed_buckets"],
        **{k: v for k, v in graph.items() if k not in ("tokens", "logprobs")},
    }
    del handle, model
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return result


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu.graph_tokens", description=__doc__.splitlines()[0]
    )
    p.add_argument(
        "--model", required=True, help="a model directory (benchmarks/gpu/gpu_model.py writes one)"
    )
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--max-prompt", type=int, default=3000, help="the longest prompt, in tokens")
    p.add_argument("--tokens", type=int, default=32, help="greedy tokens per request")
    p.add_argument("--max-rows", type=int, default=16, help="rows warmed for (the server: --max-queue)")
    p.add_argument("--pool-mb", type=int, default=1024)
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tie-nats-fp32", type=float, default=1e-4)
    p.add_argument("--tie-nats-bf16", type=float, default=0.05)
    p.add_argument("--smoke", action="store_true", help="tiny sizes: a check of the script, not a result")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.smoke:
        args.requests, args.max_prompt, args.tokens, args.pool_mb, args.chunk = 3, 120, 3, 64, 64
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: --device cpu runs the script (static steps uncaptured)")
    torch.manual_seed(args.seed)
    runs = [check(args.model, dtype, args) for dtype in args.dtypes]
    print_table(
        ["dtype", "identical", "diverged (at, gap)", "replays", "buckets at load", "warm s", "pass"],
        [
            [
                r["dtype"],
                f"{r['identical']}/{r['requests']}",
                " ".join(f"{d['request']}@{d['at']}:{d.get('gap_nats')}" for d in r["diverged"]) or "-",
                f"{r['graph_replays']}/{r['static_steps']}",
                r["buckets_captured_at_load"],
                r["warm_s"],
                r["pass"],
            ]
            for r in runs
        ],
    )
    result = {
        "benchmark": "graph_tokens",
        "env": env_info(args.device),
        "args": {k: v for k, v in vars(args).items() if k != "out"},
        "runs": runs,
        "pass": all(r["pass"] for r in runs),
    }
    write_outputs(result, args.out)
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["pass"] else 1)

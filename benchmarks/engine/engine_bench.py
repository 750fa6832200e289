"""The engine (serving/engine) on the real default model: KV bytes shared vs copied, step cost by batch size,
and batched-vs-alone agreement.

1. memory: --concurrent requests of one user over one block of ~--block-tokens tokens, all admitted, run to
   the end together. Peak KV bytes of the engine (pool: shared = the block's pages, private = the requests'
   own pages) against the per-request caches of the old path (benchmarks/engine/percache/batch.py: each request's first
   forward copies the block into a buffer of its own); the target is shared == one block and a total of at
   most 1.25x one block plus the requests' own tokens.
2. step cost: median wall time of a decode step of 1 and of --concurrent rows over the block; with --graphs
   (on a CUDA device by default) again with the decode steps replayed as CUDA graphs (serving/engine/graphs.py),
   their tokens compared with the eager steps'.
3. agreement: --requests greedy requests of different lengths (blocks of different sizes, none) run batched
   (arriving two per step, prefill in chunks) and each alone through the same engine; outputs identical,
   and where one differs, the top-2 logit gap alone at the first differing step (a near-tie if < 1e-4).
Last line of stdout: the JSON written to --out (git sha and load average in `env`).

    python -m benchmarks.engine.engine_bench --out benchmarks/results/cpu/engine_bench.json
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.common import env_info, median, print_table, write_outputs
from benchmarks.engine.percache.batch import CacheSequence, decode_step
from benchmarks.engine.percache.packed import step as packed_step
from benchmarks.gpu import floor as floors
from benchmarks.load.http_client import memory_texts
from kvmem.kv import PromptLayout, Sampling, build_item, generate
from kvmem.models import load_model
from serving.engine import runner, sampler
from serving.engine.graphs import DecodeGraphs
from serving.engine.pages import PagePool, PoolShape
from serving.engine.sequence import admit

QUESTIONS = [
    "Where do I live?",
    "What is my dog called?",
    "What did I cook on Tuesday?",
    "Who is my manager?",
]


def admitted(pool, model, ids, item, sampling, chunk=None):
    *_, seq = admit(
        pool,
        model,
        ids,
        item=item,
        max_new_tokens=sampling.max_new_tokens,
        sampling=sampling,
        prefill_chunk_tokens=chunk,
        wait_s=0,
    )
    return seq


def run_steps(model, pool, seqs, on_step=None):
    while any(not s.finished for s in seqs):
        prefills = [s for s in seqs if s.prefilling]
        decodes = [s for s in seqs if s.decoding]
        t = time.perf_counter()
        runner.step(model, pool, prefills, decodes)
        if on_step is not None:
            on_step(prefills, decodes, time.perf_counter() - t)


def cache_bytes(seq: CacheSequence) -> int:
    """Bytes of the tensors a request's own cache holds (its buffers; views of the item not counted)."""
    seen, total = set(), 0
    for layer in seq.cache.layers:
        for t in (layer.keys, layer.values):
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


def memory_and_steps(handle, layout, args, graphed: bool = False) -> dict:
    """`graphed`: decode steps through DecodeGraphs (CUDA graphs on a GPU; the static steps run eagerly on
    CPU), the rest as without."""
    model = handle.model
    mems = memory_texts(args.block_tokens // 50, 38, seed=1)
    item = build_item(handle, layout.block_ids(mems), user_id="u")
    block_bytes = item.resident_bytes
    prompts = [
        layout.prompt(mems, [], [{"role": "user", "content": QUESTIONS[k % 4] * (1 + k // 4)}]).ids
        for k in range(args.concurrent)
    ]
    sp = Sampling(max_new_tokens=args.tokens)
    pool = PagePool(PoolShape.of_model(model), args.pool_mb << 20, device=handle.device)
    pool.graphs = DecodeGraphs(model, pool) if graphed else None
    seqs = [admitted(pool, model, ids, item, sp) for ids in prompts]
    peak = dict(pool.stats())
    times = {1: [], args.concurrent: []}

    def on_step(prefills, decodes, dt):
        st = pool.stats()
        if st["pages_used"] > peak["pages_used"]:
            peak.update(st)
        if not prefills and len(decodes) in times:
            times[len(decodes)].append(dt)

    run_steps(model, pool, seqs, on_step)
    own_tokens = sum(
        len(ids) - s.stats.reused_tokens + len(s.stats.token_ids)
        for ids, s in zip(prompts, seqs, strict=True)
    )
    per_token = block_bytes / item.num_tokens
    for s in seqs:
        s.release()
    alone = admitted(pool, model, prompts[0], item, sp)
    run_steps(model, pool, [alone], on_step)
    alone.release()
    tokens = [s.stats.token_ids for s in seqs] + [alone.stats.token_ids]
    # benchmarks/gpu/floor.py: a decode step at mid-reply, its rows sharing the block's pages
    shape, card = floors.shape_of(model), floors.device_name(handle.device)
    own = [len(ids) - item.num_tokens + args.tokens // 2 for ids in prompts]  # each row's own tokens
    floor = {
        str(k): floors.floor(*floors.step_cost(shape, own[:k], shared=item.num_tokens), card, median(v))
        for k, v in times.items()
        if v
    }
    if graphed:
        g = pool.graphs
        return {
            "decode_step_s": {str(k): median(v) for k, v in times.items() if v},
            "decode_steps_timed": {str(k): len(v) for k, v in times.items()},
            "static_steps": g.steps,
            "graph_replays": g.replays,
            "buckets": sorted(f"{rows}x{kcap}" for rows, kcap in g.buckets),
            "capture_failed": g.broken,
            "floor": floor,
            "tokens": tokens,
        }
    # the old path: each request's cache after its prefill holds its own copy of the block
    old = [CacheSequence(model, ids, item=item, sampling=sp) for ids in prompts]
    packed_step(model, old, [])
    old_bytes = sum(cache_bytes(s) for s in old)
    old_times = {args.concurrent: [], 1: []}
    for group in (old, [CacheSequence(model, prompts[0], item=item, sampling=sp)]):
        while group[0].prefilling:
            group[0].prefill_step()
        while any(s.decoding for s in group):
            t = time.perf_counter()
            decode_step(model, [s for s in group if s.decoding])
            if len(group) in old_times:
                old_times[len(group)].append(time.perf_counter() - t)
    total = peak["pages_used"] * peak["page_bytes"]  # shared + prefix_cache + private
    target = 1.25 * block_bytes + own_tokens * per_token
    return {
        "block_tokens": item.num_tokens,
        "block_bytes": block_bytes,
        "concurrent": args.concurrent,
        "engine_peak_shared_bytes": peak["shared_bytes"],
        "engine_peak_private_bytes": peak["private_bytes"],
        "engine_peak_total_bytes": total,
        "own_tokens": own_tokens,
        "target_total_bytes": target,
        "meets_target": peak["shared_bytes"] <= block_bytes * 1.01 and total <= target,
        "old_path_cache_bytes_after_prefill": old_bytes,
        "decode_step_s": {str(k): median(v) for k, v in times.items() if v},
        "decode_steps_timed": {str(k): len(v) for k, v in times.items()},
        "old_path_decode_step_s": {str(k): median(v) for k, v in old_times.items() if v},
        "floor": floor,
        "tokens": tokens,
    }


def agreement(handle, layout, args) -> dict:
    model = handle.model
    blocks = [None] + [memory_texts(n, 40, seed=n) for n in (2, 8, 24)]
    items = [None] + [build_item(handle, layout.block_ids(m), user_id="u") for m in blocks[1:]]
    requests = []
    for k in range(args.requests):
        mems, item = blocks[k % 4], items[k % 4]
        text = QUESTIONS[k % 4] * (1 + k // 4)
        requests.append((layout.prompt(mems or [], [], [{"role": "user", "content": text}]).ids, item))
    lengths = [4 + (7 * k) % args.tokens for k in range(args.requests)]
    pool = PagePool(PoolShape.of_model(model), args.pool_mb << 20, device=handle.device)
    logits_log: list = []
    real_sample = sampler.sample

    def recording(logits, seqs):
        logits_log.append(logits.clone())
        return real_sample(logits, seqs)

    alone, alone_logits = [], []
    runner.sampler.sample = recording
    try:
        for (ids, item), n in zip(requests, lengths, strict=True):
            logits_log.clear()
            s = admitted(pool, model, ids, item, Sampling(max_new_tokens=n), chunk=args.chunk)
            run_steps(model, pool, [s])
            s.release()
            alone.append(s.stats.token_ids)
            alone_logits.append([row[0] for row in logits_log])
    finally:
        runner.sampler.sample = real_sample
    seqs = []
    step = 0
    while len(seqs) < len(requests) or any(not s.finished for s in seqs):
        for k in (2 * step, 2 * step + 1):
            if k < len(requests):
                ids, item = requests[k]
                seqs.append(
                    admitted(pool, model, ids, item, Sampling(max_new_tokens=lengths[k]), chunk=args.chunk)
                )
        runner.step(model, pool, [s for s in seqs if s.prefilling], [s for s in seqs if s.decoding])
        step += 1
    # alone through the engine vs a full prefill of the same ids (no block, transformers' own cache)
    full = [
        list(generate(model, ids, sampling=Sampling(max_new_tokens=n)))
        for (ids, _), n in zip(requests, lengths, strict=True)
    ]
    differ = []
    for k, (s, a) in enumerate(zip(seqs, alone, strict=True)):
        s.release()
        if s.stats.token_ids != a:
            i = next(i for i, (x, y) in enumerate(zip(s.stats.token_ids, a, strict=False)) if x != y)
            top2 = torch.topk(alone_logits[k][i], 2).values
            differ.append(
                {"request": k, "first_differing_token": i, "top2_gap_alone": float(top2[0] - top2[1])}
            )
    return {
        "requests": len(requests),
        "chunk_tokens": args.chunk,
        "outputs_identical": len(requests) - len(differ),
        "alone_equal_to_full_prefill": sum(a == f for a, f in zip(alone, full, strict=True)),
        "differing": differ,
        "differing_are_near_ties": all(d["top2_gap_alone"] < 1e-4 for d in differ),
        "pages_used_after": pool.used_pages,
        "pages_of_resident_blocks": pool.shared.page_count(),
    }


def main(argv: list[str] | None = None, handle=None) -> dict:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.engine.engine_bench", description=__doc__.splitlines()[0]
    )
    p.add_argument("--model", default=None)
    p.add_argument("--block-tokens", type=int, default=2000)
    p.add_argument("--concurrent", type=int, default=8)
    p.add_argument("--tokens", type=int, default=16, help="reply tokens per request")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--pool-mb", type=int, default=1024)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="float32 on CPU, bfloat16 on CUDA by default")
    p.add_argument(
        "--graphs",
        choices=("auto", "on", "off"),
        default="auto",
        help="also run the decode steps through serving/engine/graphs.py (auto: on a CUDA device; on CPU the "
        "static steps run eagerly) and compare their tokens with the eager steps'",
    )
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    handle = handle or load_model(args.model, device=args.device, dtype=args.dtype)
    layout = PromptLayout(handle.tokenizer)
    with torch.inference_mode():
        mem = memory_and_steps(handle, layout, args)
    graphs = None
    if args.graphs == "on" or (args.graphs == "auto" and handle.device.type == "cuda"):
        with torch.inference_mode():
            graphs = memory_and_steps(handle, layout, args, graphed=True)
        pairs = list(zip(graphs.pop("tokens"), mem["tokens"], strict=True))
        graphs["tokens_identical_to_eager"] = sum(a == b for a, b in pairs)
        # in bf16 the eager one-token rows round q.k to bf16 before the softmax, the graph's fused SDPA does
        # not: a near-tie may go the other way, so where they differ the first differing token is recorded
        graphs["first_differing_token"] = [
            next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y) if a != b else None
            for a, b in pairs
        ]
        graphs["requests"] = len(mem["tokens"])
    mem.pop("tokens")
    agree = agreement(handle, layout, args)
    print_table(
        ["figure", "value"],
        [
            ["block tokens / bytes", f"{mem['block_tokens']} / {mem['block_bytes']}"],
            [
                "engine peak shared / private",
                f"{mem['engine_peak_shared_bytes']} / {mem['engine_peak_private_bytes']}",
            ],
            ["target total (1.25 block + own)", int(mem["target_total_bytes"])],
            ["old path caches after prefill", mem["old_path_cache_bytes_after_prefill"]],
            ["decode step s (rows: s)", mem["decode_step_s"]],
            ["agreement identical", f"{agree['outputs_identical']}/{agree['requests']}"],
        ]
        + (
            []
            if graphs is None
            else [
                ["graphs: decode step s (rows: s)", graphs["decode_step_s"]],
                ["graphs: tokens = eager", f"{graphs['tokens_identical_to_eager']}/{graphs['requests']}"],
            ]
        ),
    )
    env = env_info(str(handle.device))
    result = {
        "env": {**env, "dtype": str(handle.dtype)},
        "model": handle.model_id,
        "memory": mem,
        "agreement": agree,
        "graphs": graphs,
    }
    write_outputs(result, args.out)
    return result


if __name__ == "__main__":
    main()

"""Many users' memory blocks on Qwen3-8B's shape (seeded random bf16 weights): the engine loading each user's
block from the host tier into its pages, against transformers' continuous batching re-prefilling the pasted
block with its prefix sharing on, in one process on one card (issue 44 item 8).

Workload (the same token ids for both arms): `--users` users, each a memory block of `--system` shared system
tokens plus a lognormal number of own tokens (mean `--block`); `--requests` requests, each from a user drawn by
Zipf popularity (`--zipf`), its prompt the user's block then a query of `--query` + 3k tokens (different
lengths), `--new-tokens` greedy tokens each, no end token; all requests arrive at once (one burst).
- engine: every block was prefilled once through the engine's steps and its K/V kept in host memory (pinned on
  a GPU: the host tier, serving/engine/pages.py's write copies it in non-blocking); each request is admitted
  with its user's host item (kvmem.kv.KVItem on the CPU), the pool loads it into pages when not resident and
  drops unread blocks when short. The pool (`--pool-mb`; default: an eighth of all blocks' K/V, at least two of
  the longest requests) holds about an eighth of the users' blocks: most requests load (`overcommit` in the
  JSON: all blocks' K/V over the pool). At most `--max-running` requests run at once; steps as the server's (serving/engine/runner.step, decode steps as CUDA graphs on a GPU, a lone
  prefill chunk through serving/engine/prefill_graphs.py on a GPU); on a GPU the eager step's forms run once
  before the burst, as the server's do at load (serving/engine/warm.py; `eager_warm_s`; `--no-eager-warm`).
- peer: `model.generate_batch` with attention "paged|sdpa" passed explicitly at load (never a hub kernel),
  CUDA graphs on a GPU, prefix sharing on (`allow_block_sharing=True`): each prompt is pasted text; a user's
  later requests can share the full pages of the block an earlier one prefilled. Its KV has the room the burst
  needs (more than the engine's pool).
Reported per arm: TTFT p50/p90/p99 (from the burst's start to a request's first token), tokens/s end to end;
for the engine the loads (count, bytes, seconds) and bytes loaded per request; greedy replies equal to the
peer's; the card; and `floor`: one request alone (a prefill of the median query over the median block, the
engine's ideal TTFT) against the card's bandwidth and bf16 peak (benchmarks/gpu/floor.py), with p50 over it.
`--tiny`: a tiny Qwen3 shape (the script's smoke on CPU, not figures).

    python -m benchmarks.gpu.many_users_gpu --device cuda --out benchmarks/results/gpu/<card>/many_users_qwen3_8b.json
    python -m benchmarks.gpu.many_users_gpu --tiny --device cpu --users 6 --requests 8   # smoke
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
from benchmarks.gpu.decode_peer import _sync, build_model


def workload(args, vocab: int) -> tuple[list[list[int]], list[tuple[int, list[int]]]]:
    """(each user's block ids, the requests as (user, prompt ids)), seeded."""
    g = torch.Generator().manual_seed(args.seed)
    system = torch.randint(10, vocab, (args.system,), generator=g).tolist()
    mu = torch.log(torch.tensor(float(args.block))) - 0.5 * 0.5**2  # lognormal, sigma 0.5, mean --block
    sizes = torch.exp(mu + 0.5 * torch.randn(args.users, generator=g)).round().clamp(min=1).long().tolist()
    blocks = [system + torch.randint(10, vocab, (n,), generator=g).tolist() for n in sizes]
    ranks = torch.arange(1, args.users + 1, dtype=torch.float64)
    popularity = ranks.pow(-args.zipf)
    users = torch.multinomial(popularity / popularity.sum(), args.requests, replacement=True, generator=g)
    requests = []
    for k, u in enumerate(users.tolist()):
        query = torch.randint(10, vocab, (args.query + 3 * (k % 8),), generator=g).tolist()
        requests.append((u, blocks[u] + query))
    return blocks, requests


def percentiles(xs: list[float]) -> dict:
    s = sorted(xs)

    def at(q: float) -> float:
        return s[min(len(s) - 1, int(q * len(s)))]

    return {"p50": median(s), "p90": at(0.9), "p99": at(0.99)} if s else {}


def run_steps(model, pool, seqs) -> None:
    from serving.engine import runner

    prefills = [s for s in seqs if s.prefilling]
    decodes = [s for s in seqs if s.decoding and not s.finished]
    for seq in prefills + decodes:  # a page for every position the step writes (as the batcher does)
        if not seq.table.grow(seq.position + seq.step_tokens()):
            raise RuntimeError("the page pool is too small for the running requests: raise --pool-mb")
    runner.step(model, pool, prefills, decodes)


def host_items(model, pool, blocks: list[list[int]], pinned: bool) -> list:
    """Each block prefilled once through the engine's steps, its K/V read back to host memory as a KVItem."""
    from kvmem.kv import Sampling
    from kvmem.kv.fingerprint import Fingerprint
    from kvmem.kv.item import item_from_kv
    from serving.engine.sequence import admit

    fingerprint = Fingerprint("random:seed0", "none", str(model.dtype), "", "bench", "", "")  # no tokenizer
    items = []
    for u, ids in enumerate(blocks):
        *_, seq = admit(pool, model, ids, item=None, max_new_tokens=1, wait_s=0, sampling=Sampling(1, 0.0))
        try:
            while seq.prefilling:
                run_steps(model, pool, [seq])
            kv = pool.read(pool.slots(seq.table.pages, 0, len(ids))).cpu()
        finally:
            seq.release()
        kv = kv.pin_memory() if pinned else kv
        items.append(item_from_kv(tuple(ids), kv, user_id=f"user{u}", memory_ids=(), fingerprint=fingerprint))
    return items


def engine_burst(model, pool, items, requests, new_tokens: int, max_running: int) -> dict:
    """Every request at once; admitted in order while rows and pages allow, each over its user's host item."""
    from kvmem.kv import Sampling
    from serving.engine.errors import PoolFull
    from serving.engine.sequence import AdmissionWait, admit

    device = pool.k.device
    copies0, bytes0, secs0 = pool.copies, pool.copied_bytes, pool.copied_seconds
    pending, running, done, first, replies = list(range(len(requests))), {}, [], {}, {}
    _sync(device)
    t0 = time.perf_counter()
    while pending or running:
        while pending and len(running) < max_running:
            k = pending[0]
            user, ids = requests[k]
            gen = admit(
                pool,
                model,
                ids,
                item=items[user],
                max_new_tokens=new_tokens,
                wait_s=0,
                sampling=Sampling(max_new_tokens=new_tokens, temperature=0.0),
            )
            try:
                seq = next(gen)
                while isinstance(seq, AdmissionWait):
                    raise PoolFull("no room now")
                # the pages of its whole reply taken now: admission checks the free pages, it does not keep
                # them, so requests admitted in one turn would otherwise outgrow the pool mid-reply
                if not seq.table.grow(len(ids) + new_tokens):
                    seq.release()
                    raise PoolFull("no room for its reply")
            except PoolFull:
                gen.close()
                if not running:
                    raise RuntimeError("the pool cannot hold one request: raise --pool-mb") from None
                break
            running[k] = seq
            pending.pop(0)
        run_steps(model, pool, list(running.values()))
        _sync(device)
        now = time.perf_counter() - t0
        for k, seq in list(running.items()):
            if k not in first and seq.stats.token_ids:
                first[k] = now
            if seq.finished:
                replies[k] = list(seq.stats.token_ids)
                seq.release()
                done.append(k)
                del running[k]
    wall = time.perf_counter() - t0
    tokens = sum(len(r) for r in replies.values())
    if tokens != len(requests) * new_tokens:
        raise RuntimeError(f"the engine made {tokens} tokens, not {len(requests)} x {new_tokens}")
    return {
        "wall_s": wall,
        "tokens": tokens,
        "ttft_s": [first[k] for k in range(len(requests))],
        "replies": [replies[k] for k in range(len(requests))],
        "loads": pool.copies - copies0,
        "bytes_loaded": pool.copied_bytes - bytes0,
        "load_s": pool.copied_seconds - secs0,
    }


def peer_burst(model, requests, new_tokens: int, device: torch.device, page_size: int) -> dict:
    """transformers' continuous batching over the pasted prompts, prefix sharing on (module docstring)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    inputs = [ids for _, ids in requests]
    need = sum(len(ids) + new_tokens for ids in inputs)
    cb = ContinuousBatchingConfig(
        page_size=page_size,
        num_blocks=need // page_size + 2 * len(inputs) + 8,
        max_batch_tokens=2048,
        use_cuda_graph=device.type == "cuda",
        auto_switch_to_flash=False,  # SDPA as asked: a flash kernel would come from the hub
        allow_block_sharing=True,  # prefix sharing on
    )
    gen = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    out = model.generate_batch(
        inputs,
        generation_config=gen,
        continuous_batching_config=cb,
        record_timestamps=True,
        progress_bar=False,
    )
    results = [out.get(f"req_{k}") for k in range(len(inputs))]  # its request ids, in the order given
    if any(r is None for r in results) or any(r.error for r in results):
        raise RuntimeError(f"the peer failed: {[r.error for r in results if r and r.error][:1] or 'missing'}")
    if any(len(r.timestamps) != len(r.generated_tokens) for r in results):
        raise RuntimeError("the peer's timestamps are not one per generated token: its TTFT cannot be read")
    start = min(r.created_time for r in results)
    end = max(r.timestamps[-1] for r in results)
    return {
        "run_s": end - start,
        "tokens": sum(len(r.generated_tokens) for r in results),
        "ttft_s": [r.timestamps[0] - start for r in results],
        "replies": [list(r.generated_tokens) for r in results],
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu.many_users_gpu", description=__doc__.splitlines()[0]
    )
    p.add_argument("--tiny", action="store_true", help="a tiny Qwen3 shape: the script's smoke, not figures")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="default bfloat16 on a GPU, float32 on CPU")
    p.add_argument("--users", type=int, default=64)
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--system", type=int, default=128, help="system prompt tokens every block starts with")
    p.add_argument("--block", type=int, default=1500, help="mean own tokens of a user's block (lognormal)")
    p.add_argument("--query", type=int, default=64, help="query tokens (+3k, k = request index mod 8)")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--zipf", type=float, default=1.1)
    p.add_argument("--max-running", type=int, default=32, help="the engine's running requests at most")
    p.add_argument("--pool-mb", type=int, default=None, help="the engine's page pool (default: module doc)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-peer", action="store_true")
    p.add_argument("--no-engine", action="store_true")
    p.add_argument(
        "--no-eager-warm",
        action="store_true",
        help="skip the server's eager-step warm-up (serving/engine/warm.py): what ran before it existed",
    )
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if min(args.users, args.requests, args.block, args.query, args.max_running) < 1 or args.new_tokens < 2:
        p.error("--users, --requests, --block, --query and --max-running must be >= 1, --new-tokens >= 2")
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    env = env_info(args.device)  # load average taken here, at the start
    name = floors.device_name(device)
    t_start = time.perf_counter()
    model = build_model(args.tiny, args.device, dtype)
    shape = floors.shape_of(model)
    blocks, requests = workload(args, model.config.vocab_size)
    block_tokens = sum(len(b) for b in blocks)
    result = {
        "benchmark": "many_users_gpu",
        "env": env,
        "args": vars(args),
        "device_name": name,
        "card": floors.card_of(name),  # None off the known cards (a CPU)
        "model": "tiny qwen3 shape (smoke)" if args.tiny else "Qwen3-8B shape, random weights (seed 0)",
        "dtype": str(dtype),
        "attn_implementation_requested": "paged|sdpa",
        "block_tokens_total": block_tokens,
        "block_kv_bytes_total": block_tokens * shape.kv_bytes_per_token,
        "distinct_users_requested": len({u for u, _ in requests}),
        "arms": {},
    }

    def save(arm: str, fields: dict) -> None:
        result["arms"][arm] = fields
        result["elapsed_s"] = time.perf_counter() - t_start
        if args.out:  # rewritten after every arm: a run cut short keeps what it measured
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=1))
        print(f"[many_users_gpu +{result['elapsed_s']:.0f}s] {arm} done", file=sys.stderr, flush=True)

    peer = None
    if not args.no_peer:  # the peer first, on the model as loaded (its own thread: no inference mode here)
        try:  # a warm-up burst of two short requests first (lazy initialisations), then the timed one
            peer_burst(model, requests[:2], 2, device, 16 if args.tiny else 256)
            peer = peer_burst(model, requests, args.new_tokens, device, 16 if args.tiny else 256)
            save(
                "peer",
                {
                    "tokens": peer["tokens"],
                    "tokens_per_s": peer["tokens"] / peer["run_s"],
                    "run_s": peer["run_s"],
                    "ttft_s": percentiles(peer["ttft_s"]),
                },
            )
        except Exception as exc:  # noqa: BLE001 - recorded in the JSON; the engine still runs
            save("peer", {"error": f"{type(exc).__name__}: {exc}"[:2000]})
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if not args.no_engine:
        with torch.inference_mode():
            from serving.engine import graphs, models, warm
            from serving.engine.pages import PagePool, PoolShape
            from serving.engine.prefill_graphs import PrefillGraphs

            choice = models.enable(model)
            result["engine_path"] = choice.path
            # default: an eighth of all blocks' K/V, and at least two of the longest requests
            longest = max(len(ids) for _, ids in requests) + args.new_tokens + 32
            pool_tokens = max(block_tokens // 8, 2 * longest)
            pool_bytes = (args.pool_mb << 20) if args.pool_mb else pool_tokens * shape.kv_bytes_per_token
            build_pool = PagePool(
                PoolShape.of_model(model),
                (max(len(b) for b in blocks) + 64) * shape.kv_bytes_per_token * 2,
                device=device,
            )
            items = host_items(model, build_pool, blocks, pinned=device.type == "cuda")
            del build_pool
            pool = PagePool(PoolShape.of_model(model), pool_bytes, device=device)
            if device.type == "cuda" and graphs.supports(model):  # as the server (backend._make_pool)
                pool.graphs = graphs.DecodeGraphs(model, pool)
                pool.graphs.warm(max_rows=args.max_running)
                pool.prefill_graphs = PrefillGraphs(model, pool)
                pool.prefill_graphs.warm(longest, args.query + 24)  # a chunk: the query after the block
            eager_warm_s = None
            if device.type == "cuda" and not args.no_eager_warm:  # as the server, after the graphs
                eager_warm_s = warm.warm_eager(model, pool)
            r = engine_burst(model, pool, items, requests, args.new_tokens, args.max_running)
            same = (
                None
                if peer is None
                else sum(a == b for a, b in zip(r["replies"], peer["replies"], strict=True))
            )
            mid_block, mid_query = sorted(len(b) for b in blocks)[len(blocks) // 2], args.query + 12
            p50 = median(r["ttft_s"])
            save(
                "engine",
                {
                    "tokens": r["tokens"],
                    "tokens_per_s": r["tokens"] / r["wall_s"],
                    "run_s": r["wall_s"],
                    "ttft_s": percentiles(r["ttft_s"]),
                    "pool_bytes": pool_bytes,
                    "overcommit": block_tokens * shape.kv_bytes_per_token / pool_bytes,
                    "loads": r["loads"],
                    "bytes_loaded": r["bytes_loaded"],
                    "load_s": r["load_s"],
                    "bytes_loaded_per_request": r["bytes_loaded"] / len(requests),
                    "replies_equal_to_peer": same,
                    "prefill_graph_steps": None if pool.prefill_graphs is None else pool.prefill_graphs.steps,
                    "eager_warm_s": eager_warm_s,  # None: not run (CPU, or --no-eager-warm)
                    "floor": floors.floor(
                        *floors.step_cost(shape, [mid_block], [mid_query]), name, measured_s=p50
                    ),
                },
            )
    arms = result["arms"]
    e, q = arms.get("engine", {}), arms.get("peer", {})
    table = [
        [arm, (a.get("ttft_s") or {}).get("p50"), (a.get("ttft_s") or {}).get("p99"), a.get("tokens_per_s")]
        for arm, a in (("engine", e), ("peer", q))
    ]
    if e.get("ttft_s") and q.get("ttft_s"):
        result["engine_over_peer"] = {
            "ttft_p50": e["ttft_s"]["p50"] / q["ttft_s"]["p50"],
            "ttft_p99": e["ttft_s"]["p99"] / q["ttft_s"]["p99"],
            "tokens_per_s": e["tokens_per_s"] / q["tokens_per_s"],
        }
    result["elapsed_s"] = time.perf_counter() - t_start
    print_table(["arm", "TTFT p50 s", "TTFT p99 s", "tok/s"], table)
    write_outputs(result, args.out)
    return result


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()

"""In-process decode throughput of N concurrent requests: the model loop's old round-robin (one forward per
request per token) against batched decode (one forward per step for all), same requests, arms alternated.

Half the requests inject a KV block, half have none; greedy; the server's path before the engine (the
per-request caches of benchmarks/engine/percache/), without HTTP, search or tokenizing. Reports tokens/s per arm, the ratio, and whether both arms' tokens are identical; records the
load average and other processes' CPU share (this machine is shared). Last line of stdout: the JSON.

    python -m benchmarks.engine.batch_decode --requests 8 --tokens 16 --reps 3 --out benchmarks/results/cpu/batch_decode.json

Its `--served` arm (the server's batcher over per-request caches, packed steps against unpacked) went when the
server stopped running them; its last result: benchmarks/results/cpu/batch_packed.json.
"""

from __future__ import annotations

import argparse
import os
import time

from benchmarks.common import OthersCpu, env_info, median, print_table, write_outputs
from benchmarks.engine.percache.batch import CacheSequence, decode_step
from benchmarks.load.http_client import memory_texts
from kvmem.kv import PromptLayout, Sampling, build_item, generate
from kvmem.models import load_model

QUESTIONS = (
    "What do you remember about my plans?",
    "Summarize what you know about me in one sentence.",
    "Which city did I mention?",
    "What should I do this weekend?",
)


def round_robin(model, requests, sampling) -> list[list[int]]:
    """Today's model loop: one generator per request, advanced one token per turn."""
    gens = [generate(model, ids, item=item, sampling=sampling) for ids, item in requests]
    out: list[list[int]] = [[] for _ in gens]
    live = list(range(len(gens)))
    while live:
        for k in list(live):
            try:
                out[k].append(next(gens[k]))
            except StopIteration:
                live.remove(k)
    return out


def batched(model, requests, sampling) -> list[list[int]]:
    """The batcher's schedule: prefills (a first token each), then one decode forward per step for all."""
    seqs = [CacheSequence(model, ids, item=item, sampling=sampling) for ids, item in requests]
    for s in seqs:
        while s.prefilling:
            s.prefill_step()
    while any(s.decoding for s in seqs):
        decode_step(model, [s for s in seqs if s.decoding])
    return [s.stats.token_ids for s in seqs]


def main(argv: list[str] | None = None, handle=None) -> dict:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.engine.batch_decode", description=__doc__.splitlines()[0]
    )
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--model", default=None)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    handle = handle or load_model(args.model, device="cpu", dtype="float32")
    model, layout = handle.model, PromptLayout(handle.tokenizer)
    texts = memory_texts(8, 60, seed=1)  # http_load's KV user
    item = build_item(handle, layout.block_ids(texts), user_id="u")
    requests = []
    for k in range(args.requests):
        mems = texts if k % 2 == 0 else []
        msgs = [{"role": "user", "content": QUESTIONS[k % len(QUESTIONS)]}]
        requests.append((layout.prompt(mems, [], msgs).ids, item if mems else None))
    sampling = Sampling(max_new_tokens=args.tokens)
    arms = {"round_robin": round_robin, "batched": batched}
    times: dict[str, list[float]] = {name: [] for name in arms}
    tokens: dict[str, list[list[int]]] = {}
    others = OthersCpu()
    others.start()
    load_start = os.getloadavg()
    round_robin(model, requests[:2], Sampling(max_new_tokens=2))  # warm-up
    batched(model, requests[:2], Sampling(max_new_tokens=2))
    for _ in range(args.reps):
        for name, fn in arms.items():
            t0 = time.perf_counter()
            tokens[name] = fn(model, requests, sampling)
            times[name].append(time.perf_counter() - t0)
    total = sum(len(t) for t in tokens["batched"])
    row = {
        "requests": args.requests,
        "tokens_each": args.tokens,
        "reps": args.reps,
        "round_robin_s": median(times["round_robin"]),
        "batched_s": median(times["batched"]),
        "round_robin_tokens_per_s": total / median(times["round_robin"]),
        "batched_tokens_per_s": total / median(times["batched"]),
        "identical": tokens["batched"] == tokens["round_robin"],
        "loadavg_start": list(load_start),
        "others_cpu_share": others.share(),
    }
    row["speedup"] = row["batched_tokens_per_s"] / row["round_robin_tokens_per_s"]
    print_table(
        [
            "Requests",
            "Tokens each",
            "Round-robin tok/s",
            "Batched tok/s",
            "Speedup",
            "Identical",
            "Others' CPU",
        ],
        [
            [
                args.requests,
                args.tokens,
                row["round_robin_tokens_per_s"],
                row["batched_tokens_per_s"],
                row["speedup"],
                row["identical"],
                row["others_cpu_share"],
            ]
        ],
    )
    result = {"env": {**env_info("cpu"), "model": handle.model_id}, "decode": row}
    write_outputs(result, args.out)
    return result


if __name__ == "__main__":
    main()

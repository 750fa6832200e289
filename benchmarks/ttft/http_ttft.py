"""TTFT through the HTTP server with the official openai client (streaming, time to first content chunk).

Arms, each with the same query: memories as KV (the user's block is KV-resident), the same memories as
text (a server whose block budget is 0, so they come back from search and are prefilled), and no memory;
at concurrency 1, 4 and 8 (--levels), on one backend or several in turn (--backends). The in-process TTFT of the KV prompt is the baseline, measured in the same run in
alternation with HTTP requests to the idle server (pairs), so both see the same machine state.

    python -m benchmarks.ttft.http_ttft --spawn --quick --out benchmarks/results/cpu/http_ttft.json
    python -m benchmarks.ttft.http_ttft --spawn --backend fake --quick --out /tmp/h.json    # plumbing only
    python -m benchmarks.ttft.http_ttft --spawn --backends transformers vllm --quick --levels 1 4 8 16 \
        --no-in-process --out benchmarks/results/cpu/http_ttft_backends.json   # both backends, one run
    python -m benchmarks.ttft.http_ttft --base-url http://127.0.0.1:8000 \
        [--text-base-url http://127.0.0.1:8001] --out h.json   # running servers (the second: block budget 0)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
import uuid
from contextlib import nullcontext
from dataclasses import asdict, dataclass

from benchmarks.common import env_info, median, p90, print_table, write_outputs
from benchmarks.load.http_client import (
    QUERY,
    _get,
    memory_texts,
    one_request,
    seed,
    server_means,
    server_totals,
    spawned_server,
    texts_digest,
    wait_for_block,
)
from benchmarks.load.http_load import BACKENDS, percentile


@dataclass
class ArmResult:
    arm: str
    concurrency: int
    num_requests: int
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_mean_s: float
    cached_tokens: int
    prompt_tokens: int
    errors: int
    query: str = QUERY
    memories_sha256: str = ""  # of the memory texts seeded for the arm's user ("" for none)
    memory_tiers: dict | None = None  # tier -> memories the server reported using (last reply)
    server_ttft_mean_s: float | None = None  # the server's own TTFT (arrival -> first token), /metrics
    server_prefill_mean_s: float | None = None  # the backend's share of it: inject + prefill, /metrics
    backend: str = ""
    ttft_p99_s: float = float("nan")
    tokens_per_s: float = 0.0  # completion tokens of all the arm's requests over its wall time


def run_arm(
    base: str,
    arm: str,
    user: str,
    concurrency: int,
    per_client: int,
    max_tokens: int,
    texts: list[str],
    backend: str = "",
    fresh_system: bool = False,
) -> ArmResult:
    """`concurrency` clients, each sending `per_client` requests in turn. The server-side mean TTFT is the
    /metrics delta over the arm (exact while nothing else talks to the server)."""
    before = server_totals(base)
    started = time.monotonic()
    tokens = [0]
    ttfts: list[float] = []
    info: list[tuple[int, int, tuple]] = []
    errors = [0]
    lock = threading.Lock()

    def client_loop() -> None:
        for _ in range(per_client):
            try:
                # a system message no earlier request had: nothing after the block can come from an engine's
                # prefix cache (vLLM's caches a repeated text prompt), so the text arm is a cold prefill
                system = f"Request {uuid.uuid4().hex}." if fresh_system else None
                reply = one_request(base, user, max_tokens, system=system)
                with lock:
                    ttfts.append(reply.ttft_s)
                    tokens[0] += reply.completion_tokens
                    info.append((reply.cached_tokens, reply.prompt_tokens, reply.memory_used))
            except Exception:  # noqa: BLE001 - counted and reported as errors
                with lock:
                    errors[0] += 1

    threads = [threading.Thread(target=client_loop) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - started
    means = server_means(before, server_totals(base))
    cached, prompt, used = info[-1] if info else (0, 0, ())
    tiers: dict[str, int] = {}
    for _, tier in used:
        tiers[tier] = tiers.get(tier, 0) + 1
    return ArmResult(
        arm,
        concurrency,
        len(ttfts),
        median(ttfts) if ttfts else float("nan"),
        p90(ttfts) if ttfts else float("nan"),
        sum(ttfts) / len(ttfts) if ttfts else float("nan"),
        cached,
        prompt,
        errors[0],
        QUERY,
        texts_digest(texts),
        tiers,
        means.get("ttft"),
        means.get("prefill"),
        backend,
        percentile(ttfts, 0.99),
        tokens[0] / elapsed,
    )


def block_texts(base: str, user: str) -> list[str]:
    """The user's KV block as the server laid it out (memory texts in block order)."""
    plan = _get(f"{base}/v1/memories/plan?user_id={user}")
    return [_get(f"{base}/v1/memories/{mid}?user_id={user}")["text"] for mid in plan["block"]["memory_ids"]]


def paired_in_process(
    base: str, user: str, texts: list[str], model: str | None, pairs: int, max_tokens: int, warmup: int = 2
) -> dict:
    """HTTP TTFT vs the in-process TTFT of the same prompt, as ttft_grid measures it (fetch the item from a
    store, inject, prefill), taken in alternation while the server is idle, so both see the same machine.

    The in-process side builds its own copy of the block in this process from the server's block texts, in
    the server's order; the prompt is laid out exactly as the server lays it out (same layout, same query),
    which `same_prompt_tokens` checks against the server's reported prompt length."""
    from openai import OpenAI

    from benchmarks.ttft.ttft_grid import first_token_s
    from kvmem.kv import KVStoreConfig, PromptLayout, TieredKVStore, build_item
    from kvmem.models import load_model

    handle = load_model(model)
    layout = PromptLayout(handle.tokenizer)
    ids = list(layout.prompt(texts, [], [{"role": "user", "content": QUERY}]).ids)
    client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=600)
    http_s: list[float] = []
    local_s: list[float] = []
    server_s: list[dict[str, float]] = []  # this request's server TTFT and backend prefill
    prompt_tokens = 0
    with tempfile.TemporaryDirectory() as tmp:
        store = TieredKVStore(KVStoreConfig(directory=tmp), handle.fingerprint)
        item = build_item(handle, layout.block_ids(texts), user_id=user)
        store.put(item, persist=False)
        for k in range(warmup + pairs):
            before = server_totals(base)
            reply = one_request(base, user, max_tokens, client=client)
            server = server_means(before, server_totals(base))
            local = first_token_s(handle.model, ids, item, store, "cpu")
            prompt_tokens = reply.prompt_tokens
            if k >= warmup:
                http_s.append(reply.ttft_s)
                local_s.append(local)
                server_s.append(server)
    diffs_ms = [1000 * (a - b) for a, b in zip(http_s, local_s, strict=True)]
    split = {}
    if all("ttft" in s and "prefill" in s for s in server_s):
        # where the difference goes, median of each pair's parts: HTTP + client, the server's own steps
        # before the backend (queueing, plan, search, layout), and its prefill against the in-process one
        split = {
            "http_client_ms": median([1000 * (h - s["ttft"]) for h, s in zip(http_s, server_s, strict=True)]),
            "server_before_backend_ms": median([1000 * (s["ttft"] - s["prefill"]) for s in server_s]),
            "prefill_minus_inprocess_ms": median(
                [1000 * (s["prefill"] - lo) for s, lo in zip(server_s, local_s, strict=True)]
            ),
        }
    return {
        "prompt_tokens": len(ids),
        "block_tokens": item.num_tokens,
        "pairs": pairs,
        "http_kv_ttft_p50_s": median(http_s),
        "kv_ttft_p50_s": median(local_s),
        "kv_ttft_p90_s": p90(local_s),
        "http_minus_inprocess_ms": median(diffs_ms),  # median of the paired differences
        "within_15ms": abs(median(diffs_ms)) <= 15.0,
        **split,
        "same_prompt_tokens": len(ids) == prompt_tokens,
    }


def run_backend(args: argparse.Namespace, backend: str, texts: list[str], per_client) -> dict:
    """Every arm at every level on one backend: the KV and none arms on a server with a block budget, the
    text arm on a second with budget 0 (spawned in turn, or the given ones)."""
    run_id = (
        "" if args.base_url is None else f"-{os.getpid()}-{int(time.time())}"
    )  # fresh users on a live server
    kv_user, text_user, none_user = f"kv-user{run_id}", f"text-user{run_id}", f"nobody{run_id}"
    results: list[ArmResult] = []
    inproc = None
    levels = args.levels
    with tempfile.TemporaryDirectory() as tmp:
        # the admission bound above the highest level: the latency under load is measured, not 429s
        kw = dict(backend=backend, model=args.model, top_k=args.memories, queue_size=max(16, 2 * max(levels)))

        def kv_server():
            return (
                spawned_server(block_budget=8192, data_dir=os.path.join(tmp, "kv"), **kw)
                if args.base_url is None
                else nullcontext(args.base_url.rstrip("/"))
            )

        def text_server():
            if args.base_url is not None:
                return nullcontext(args.text_base_url.rstrip("/") if args.text_base_url else None)
            return spawned_server(block_budget=0, data_dir=os.path.join(tmp, "text"), **kw)

        with kv_server() as base:
            seed(base, kv_user, texts)
            plan = wait_for_block(base, kv_user, len(texts))
            ordered = block_texts(base, kv_user)
            print(
                f"# {backend}: KV block of {plan['block']['tokens']} tokens, "
                f"{len(plan['block']['memory_ids'])} memories",
                file=sys.stderr,
            )
            one_request(base, kv_user, args.max_tokens)  # warm-up
            one_request(base, none_user, args.max_tokens)
            for c in levels:
                for arm, user, arm_texts in (("kv", kv_user, texts), ("none", none_user, [])):
                    results.append(
                        run_arm(
                            base,
                            arm,
                            user,
                            c,
                            per_client(c),
                            args.max_tokens,
                            arm_texts,
                            backend,
                            args.fresh_system,
                        )
                    )
            if backend == "transformers" and not args.no_in_process:
                print(f"# in-process baseline: {args.pairs} pairs", file=sys.stderr)
                inproc = paired_in_process(base, kv_user, ordered, args.model, args.pairs, args.max_tokens)
        with text_server() as base:
            if base is not None:
                seed(base, text_user, texts)
                one_request(base, text_user, args.max_tokens)  # warm-up
                for c in levels:
                    results.append(
                        run_arm(
                            base,
                            "text",
                            text_user,
                            c,
                            per_client(c),
                            args.max_tokens,
                            texts,
                            backend,
                            args.fresh_system,
                        )
                    )
    order = {"kv": 0, "text": 1, "none": 2}
    results.sort(key=lambda r: (r.concurrency, order[r.arm]))
    by = {(r.arm, r.concurrency): r for r in results}
    summary: dict = {
        "fresh_system": args.fresh_system,
        "block_tokens": plan.get("block", {}).get("tokens"),
        "kv_vs_text_x": {
            str(c): by[("text", c)].ttft_p50_s / by[("kv", c)].ttft_p50_s for c in levels if ("text", c) in by
        },
        # the TTFT cut of memories as KV, p50 against p50, per level (target: >= 90% at one client)
        "kv_cut_vs_text_pct": {
            str(c): 100 * (1 - by[("kv", c)].ttft_p50_s / by[("text", c)].ttft_p50_s)
            for c in levels
            if ("text", c) in by
        },
        "kv_cut_vs_none_pct": {
            str(c): 100 * (1 - by[("kv", c)].ttft_p50_s / by[("none", c)].ttft_p50_s) for c in levels
        },
    }
    if ("kv", 1) in by and by[("kv", 1)].server_ttft_mean_s is not None:
        kv1 = by[("kv", 1)]  # sequential requests: the client's mean minus the server's is HTTP + client
        summary["http_client_overhead_ms"] = 1000 * (kv1.ttft_mean_s - kv1.server_ttft_mean_s)
    if inproc is not None:
        summary["in_process"] = inproc
    print(f"# {backend} summary: {json.dumps(summary)}", file=sys.stderr)
    return {"arms": results, "summary": summary}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.ttft.http_ttft", description=__doc__.splitlines()[0]
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="per client max(1, 4 // concurrency) requests (>= 4 samples a level)",
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument("--spawn", action="store_true", help="start the servers (the default)")
    where.add_argument("--base-url", default=None, help="a running server (kv and none arms)")
    p.add_argument("--text-base-url", default=None, help="with --base-url: a server with block budget 0")
    p.add_argument("--backend", default="transformers", choices=BACKENDS)
    p.add_argument("--backends", nargs="+", default=None, choices=BACKENDS, help="several, in turn (spawned)")
    p.add_argument("--model", default=None)
    p.add_argument("--memories", type=int, default=8, help="memories per user (all fit in the block)")
    p.add_argument("--words", type=int, default=190, help="words per memory (8 x 190 words ~ 2k tokens)")
    p.add_argument("--requests", type=int, default=3, help="requests per client")
    p.add_argument("--levels", type=int, nargs="+", default=[1, 4, 8], help="concurrency levels")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--pairs", type=int, default=8, help="HTTP / in-process pairs for the baseline")
    p.add_argument("--no-in-process", action="store_true", help="skip the in-process baseline")
    p.add_argument(
        "--fresh-system",
        action="store_true",
        help="every request opens with a system message no other had: no prefix-cache hit past the block",
    )
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.text_base_url and not args.base_url:
        p.error("--text-base-url goes with --base-url")
    backends = args.backends or [args.backend]
    if len(backends) > 1 and args.base_url:
        p.error("--backends with more than one backend spawns its servers: drop --base-url")
    if len(set(backends)) != len(backends):
        p.error(f"--backends names a backend twice: {backends}")
    if min(args.levels) < 1:
        p.error(f"--levels must be >= 1, got {args.levels}")
    levels = tuple(args.levels)

    def per_client(c: int) -> int:
        return max(1, 4 // c) if args.quick else args.requests

    texts = memory_texts(args.memories, args.words)
    runs = {backend: run_backend(args, backend, texts, per_client) for backend in backends}
    results = [r for run in runs.values() for r in run["arms"]]
    print_table(
        [
            "Backend",
            "Arm",
            "Conc",
            "Requests",
            "TTFT p50 (s)",
            "TTFT p99 (s)",
            "Tokens/s",
            "Server mean (s)",
            "Cached tok",
            "Prompt tok",
            "Errors",
        ],
        [
            [
                r.backend,
                r.arm,
                r.concurrency,
                r.num_requests,
                r.ttft_p50_s,
                r.ttft_p99_s,
                round(r.tokens_per_s, 2),
                "-" if r.server_ttft_mean_s is None else r.server_ttft_mean_s,
                r.cached_tokens,
                r.prompt_tokens,
                r.errors,
            ]
            for r in results
        ],
    )
    by_backend = {backend: run["summary"] for backend, run in runs.items()}
    # one backend: its summary at the top level, as older results have it
    summary = (
        {**by_backend[backends[0]], "by_backend": by_backend}
        if len(backends) == 1
        else {"by_backend": by_backend}
    )
    result = {
        "env": {
            **env_info("cpu"),
            "backend": backends[0] if len(backends) == 1 else backends,
            "memories": args.memories,
            "words": args.words,
            "query": QUERY,
            "max_tokens": args.max_tokens,
            "requests_per_client": {str(c): per_client(c) for c in levels},
            "levels": list(levels),
            "server": "spawned" if args.base_url is None else args.base_url,
            "load_avg_1m_at_end": os.getloadavg()[0],
        },
        "arms": [asdict(r) for r in results],
        "summary": summary,
    }
    write_outputs(result, args.out)
    return result


if __name__ == "__main__":
    main()

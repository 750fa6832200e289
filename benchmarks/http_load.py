"""Sustained load: N concurrent streaming openai clients for a fixed time against one server on loopback.

Half the clients ask as a user whose memories are a KV block, half as a user with no memories.
Reports requests completed, errors by type (expected: none), p50/p99 TTFT and output tokens/s.

    python -m benchmarks.http_load --spawn --clients 8 --duration-s 60 --out benchmarks/results/cpu/http_load.json
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from collections import Counter
from contextlib import nullcontext

from benchmarks.common import env_info, median, print_table, write_outputs
from benchmarks.http_client import memory_texts, one_request, seed, spawned_server, wait_for_block

QUESTIONS = (
    "What do you remember about my plans?",
    "Summarize what you know about me in one sentence.",
    "Which city did I mention?",
    "What should I do this weekend?",
)


def percentile(xs: list[float], q: float) -> float:
    ordered = sorted(xs)
    return (
        float(ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]) if ordered else float("nan")
    )


def client_loop(base: str, user: str, k: int, deadline: float, max_tokens: int, out: dict, lock) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)
    i = 0
    while time.monotonic() < deadline:
        try:
            reply = one_request(base, user, max_tokens, QUESTIONS[(k + i) % len(QUESTIONS)], client)
            with lock:
                out["ttft"].append(reply.ttft_s)
                out["tokens"] += reply.completion_tokens
                out["completed"] += 1
        except Exception as exc:  # noqa: BLE001 - counted by type and reported
            with lock:
                out["errors"][type(exc).__name__] += 1
        i += 1


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.http_load", description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--duration-s", type=float, default=60.0)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--spawn", action="store_true", help="start a server (else --base-url)")
    p.add_argument("--base-url", default=None)
    p.add_argument("--backend", default="transformers", choices=["transformers", "fake"])
    p.add_argument("--model", default=None)
    p.add_argument("--memories", type=int, default=8)
    p.add_argument("--words", type=int, default=60)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if not args.spawn and not args.base_url:
        p.error("give --spawn or --base-url")
    texts = memory_texts(args.memories, args.words, seed=1)
    with tempfile.TemporaryDirectory() as tmp:
        ctx = (
            spawned_server(
                backend=args.backend,
                model=args.model,
                block_budget=8192,
                top_k=args.memories,
                data_dir=os.path.join(tmp, "data"),
            )
            if args.spawn
            else nullcontext(args.base_url)
        )
        with ctx as base:
            suffix = (
                "" if args.spawn else f"-{os.getpid()}-{int(time.time())}"
            )  # fresh users on a live server
            users = [f"load-kv{suffix}", f"load-none{suffix}"]
            seed(base, users[0], texts)
            wait_for_block(base, users[0], len(texts))
            out = {"ttft": [], "tokens": 0, "completed": 0, "errors": Counter()}
            lock = threading.Lock()
            started = time.monotonic()
            deadline = started + args.duration_s
            threads = [
                threading.Thread(
                    target=client_loop, args=(base, users[k % 2], k, deadline, args.max_tokens, out, lock)
                )
                for k in range(args.clients)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            elapsed = time.monotonic() - started
    row = {
        "clients": args.clients,
        "duration_s": elapsed,
        "completed": out["completed"],
        "errors": dict(out["errors"]),
        "num_errors": sum(out["errors"].values()),
        "ttft_p50_s": median(out["ttft"]) if out["ttft"] else float("nan"),
        "ttft_p99_s": percentile(out["ttft"], 0.99),
        "output_tokens": out["tokens"],
        "tokens_per_s": out["tokens"] / elapsed,
    }
    print(f"# {row}", file=sys.stderr)
    print_table(
        ["Clients", "Seconds", "Completed", "Errors", "TTFT p50 (s)", "TTFT p99 (s)", "Tokens/s"],
        [
            [
                row["clients"],
                round(elapsed, 1),
                row["completed"],
                row["num_errors"],
                row["ttft_p50_s"],
                row["ttft_p99_s"],
                round(row["tokens_per_s"], 2),
            ]
        ],
    )
    result = {"env": {**env_info("cpu"), "backend": args.backend, "max_tokens": args.max_tokens}, "load": row}
    write_outputs(result, args.out)
    return result


if __name__ == "__main__":
    main()

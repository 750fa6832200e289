"""Sustained load: N concurrent streaming openai clients for a fixed time against one server on loopback.

Half the clients ask as a user whose memories are a KV block, half as a user with no memories (one client:
the KV user). Reports, per backend and per concurrency level, requests completed, errors by type (expected:
none), p50/p99 TTFT (all clients, and the KV user's alone) and total output tokens/s. Several backends in one
run: one spawned server each, in turn, every level against the same server.

    python -m benchmarks.load.http_load --spawn --clients 8 --duration-s 60 --out benchmarks/results/cpu/http_load.json
    python -m benchmarks.load.http_load --spawn --backends transformers vllm --levels 1 4 8 16 --duration-s 30 \
        --out benchmarks/results/cpu/http_load_backends.json
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

from benchmarks.common import OthersCpu, env_info, median, print_table, write_outputs
from benchmarks.load.http_client import memory_texts, one_request, seed, spawned_server, wait_for_block

BACKENDS = ("transformers", "vllm", "fake")
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
                if k % 2 == 0:  # the KV user's clients
                    out["kv_ttft"].append(reply.ttft_s)
                out["tokens"] += reply.completion_tokens
                out["completed"] += 1
        except Exception as exc:  # noqa: BLE001 - counted by type and reported
            with lock:
                out["errors"][type(exc).__name__] += 1
        i += 1


def run_level(base: str, users: list[str], clients: int, duration_s: float, max_tokens: int) -> dict:
    """`clients` threads for `duration_s` against one server: its row of the table."""
    out = {"ttft": [], "kv_ttft": [], "tokens": 0, "completed": 0, "errors": Counter()}
    lock = threading.Lock()
    meter = OthersCpu()
    meter.start()
    load0 = os.getloadavg()[0]
    started = time.monotonic()
    deadline = started + duration_s
    threads = [
        threading.Thread(target=client_loop, args=(base, users[k % 2], k, deadline, max_tokens, out, lock))
        for k in range(clients)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - started
    return {
        "clients": clients,
        "duration_s": elapsed,
        "completed": out["completed"],
        "errors": dict(out["errors"]),
        "num_errors": sum(out["errors"].values()),
        "ttft_p50_s": median(out["ttft"]) if out["ttft"] else float("nan"),
        "ttft_p99_s": percentile(out["ttft"], 0.99),
        "kv_ttft_p50_s": median(out["kv_ttft"]) if out["kv_ttft"] else float("nan"),
        "kv_ttft_p99_s": percentile(out["kv_ttft"], 0.99),
        "output_tokens": out["tokens"],
        "tokens_per_s": out["tokens"] / elapsed,
        # the client threads run in this process, so "others" is the server (and anything else on the machine)
        "others_cpu_share": meter.share(),
        "load_avg_1m": [load0, os.getloadavg()[0]],
    }


def run_backend(args: argparse.Namespace, backend: str, texts: list[str]) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        ctx = (
            spawned_server(
                backend=backend,
                model=args.model,
                block_budget=8192,
                top_k=args.memories,
                data_dir=os.path.join(tmp, "data"),
                queue_size=max(16, 2 * max(args.levels)),  # the load, not the admission bound, is measured
                extra=tuple(args.serve_args.split()),
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
            for user in users:  # warm-up, off the clock
                one_request(base, user, args.max_tokens)
            rows = []
            for clients in args.levels:
                row = {
                    "backend": backend,
                    **run_level(base, users, clients, args.duration_s, args.max_tokens),
                }
                print(f"# {row}", file=sys.stderr)
                rows.append(row)
            return rows


def summarize(rows: list[dict], target_level: int = 8) -> dict:
    """Per backend: the KV user's TTFT p50 at `target_level` clients over its single-client figure."""
    out: dict = {}
    for backend in dict.fromkeys(r["backend"] for r in rows):
        by = {r["clients"]: r for r in rows if r["backend"] == backend}
        entry = {"tokens_per_s": {str(c): r["tokens_per_s"] for c, r in by.items()}}
        if 1 in by and target_level in by:
            entry[f"kv_ttft_p50_{target_level}_over_1_x"] = (
                by[target_level]["kv_ttft_p50_s"] / by[1]["kv_ttft_p50_s"]
            )
        out[backend] = entry
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.load.http_load", description=__doc__.splitlines()[0]
    )
    p.add_argument("--clients", type=int, default=8, help="one concurrency level (see --levels)")
    p.add_argument(
        "--levels", type=int, nargs="+", default=None, help="concurrency levels (default --clients)"
    )
    p.add_argument("--duration-s", type=float, default=60.0, help="per level")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--spawn", action="store_true", help="start a server per backend (else --base-url)")
    p.add_argument("--base-url", default=None)
    p.add_argument("--backend", default="transformers", choices=BACKENDS)
    p.add_argument("--backends", nargs="+", default=None, choices=BACKENDS, help="several, in turn (--spawn)")
    p.add_argument("--model", default=None)
    p.add_argument("--memories", type=int, default=8)
    p.add_argument("--words", type=int, default=60)
    p.add_argument(
        "--serve-args",
        default="",
        help='more `kvmem serve` flags for spawned servers, e.g. "--device cuda" or "--kv-pool-mb 256"',
    )
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    loadavg_start = list(os.getloadavg())
    if not args.spawn and not args.base_url:
        p.error("give --spawn or --base-url")
    backends = args.backends or [args.backend]
    if len(backends) > 1 and not args.spawn:
        p.error("--backends with more than one backend needs --spawn")
    if len(set(backends)) != len(backends):
        p.error(f"--backends names a backend twice: {backends}")
    args.levels = args.levels or [args.clients]
    if min(args.levels) < 1:
        p.error(f"--levels must be >= 1, got {args.levels}")
    texts = memory_texts(args.memories, args.words, seed=1)
    rows = [row for backend in backends for row in run_backend(args, backend, texts)]
    print_table(
        [
            "Backend",
            "Clients",
            "Seconds",
            "Completed",
            "Errors",
            "TTFT p50 (s)",
            "TTFT p99 (s)",
            "KV p50 (s)",
            "Tokens/s",
        ],
        [
            [
                r["backend"],
                r["clients"],
                round(r["duration_s"], 1),
                r["completed"],
                r["num_errors"],
                r["ttft_p50_s"],
                r["ttft_p99_s"],
                r["kv_ttft_p50_s"],
                round(r["tokens_per_s"], 2),
            ]
            for r in rows
        ],
    )
    flags = args.serve_args.split()
    # the servers' device (`--device` in --serve-args; else kvmem serve's auto), not the clients'
    device = flags[flags.index("--device") + 1] if "--device" in flags[:-1] else "auto"
    env = {
        **env_info(device),
        "serve_args": args.serve_args,
        # before any server was spawned: `loadavg` above is read at the end, with this run's own load in it
        "loadavg_start": loadavg_start,
        "backend": backends[0] if len(backends) == 1 else backends,
        "max_tokens": args.max_tokens,
        "memories": args.memories,
        "words": args.words,
        "duration_s_per_level": args.duration_s,
    }
    result = {"env": env, "runs": rows, "summary": summarize(rows)}
    if len(rows) == 1:
        result["load"] = rows[0]  # the single-run shape older results have
    write_outputs(result, args.out)
    return result


if __name__ == "__main__":
    main()

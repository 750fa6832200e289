"""Replicas behind the router: sustained load through HAProxy with 1, 2, 3 replicas, then a replica killed.

Each level starts a cluster with the product's own `serving.ops.cluster.up` (what `scripts/cluster.sh up` runs:
PostgreSQL, Redis, N `kvmem serve` replicas over one data dir, HAProxy hashing on X-Kvmem-User), seeds
`--users` users with memories through the router, waits until each user's block is built on the replica that
serves them, and runs `--clients` streaming clients for `--duration-s` (client k asks as user k mod users).
Reports total output tokens/s, TTFT p50/p99 and requests per replica.

`--failover`: on the largest level, under the same load, kill -9 the replica serving the most users a third
of the way in, and report requests failed, the seconds from the kill until each of its users gets a first
token again (from another replica), how many of those first answers came from KV (cached_tokens > 0), and
the seconds until each gets a first token served from KV again.

    python -m benchmarks.cluster.cluster_load --levels 1 2 3 --failover --duration-s 30 \\
        --out benchmarks/results/cpu/cluster_load.json
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from benchmarks.common import env_info, median, write_outputs
from benchmarks.load.http_client import memory_texts, one_request, seed, wait_for_block
from benchmarks.load.http_load import QUESTIONS, percentile
from serving.ops.cluster import ClusterState, down, replica_env, up


class Load:
    """Client threads through the router until `stop`; every answer and error is recorded with its time."""

    def __init__(self, base: str, users: list[str], clients: int, max_tokens: int) -> None:
        self.base, self.users, self.max_tokens = base, users, max_tokens
        self.lock = threading.Lock()
        # (monotonic time of its first token, user, Reply): when the user was served
        self.answers: list[tuple[float, str, object]] = []
        self.errors: list[tuple[float, str, str]] = []  # (time, user, exception type)
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._client, args=(k,)) for k in range(clients)]

    def _client(self, k: int) -> None:
        from openai import OpenAI

        user = self.users[k % len(self.users)]
        client = OpenAI(base_url=f"{self.base}/v1", api_key="unused", max_retries=0, timeout=300)
        i = 0
        while not self.stop.is_set():
            question = QUESTIONS[(k + i) % len(QUESTIONS)]
            started = time.monotonic()
            try:
                reply = one_request(
                    self.base, user, self.max_tokens, question, client, headers={"X-Kvmem-User": user}
                )
                with self.lock:
                    self.answers.append((started + reply.ttft_s, user, reply))
            except Exception as exc:  # noqa: BLE001 - counted by type and reported
                with self.lock:
                    self.errors.append((time.monotonic(), user, type(exc).__name__))
                time.sleep(0.05)
            i += 1

    def run(self, duration_s: float, during=None) -> float:
        started = time.monotonic()
        for t in self.threads:
            t.start()
        if during is not None:
            during()
        time.sleep(max(0.0, started + duration_s - time.monotonic()))
        self.stop.set()
        for t in self.threads:
            t.join()
        return time.monotonic() - started


def prepare(state: ClusterState, users: list[str], texts: list[str], max_tokens: int) -> dict[str, str]:
    """Seeds every user through the router, waits for each block on its replica, warms up; user -> replica."""
    from benchmarks.load.http_client import _post

    homes = {}
    for user in users:
        seed(state.router_url, user, texts)  # user_id in the body: the router sends it to the user's replica
        _post(f"{state.router_url}/v1/memories/plan/prewarm", {"user_id": user})
    for user in users:
        wait_for_block(state.router_url, user, len(texts))
        homes[user] = one_request(state.router_url, user, max_tokens, headers={"X-Kvmem-User": user}).replica
    return homes


def level_row(replicas: int, load: Load, elapsed: float) -> dict:
    ttfts = [r.ttft_s for _, _, r in load.answers]
    return {
        "replicas": replicas,
        "replica_threads": int(replica_env(replicas)["OMP_NUM_THREADS"]),  # torch CPU threads per replica
        "clients": len(load.threads),
        "duration_s": elapsed,
        "completed": len(load.answers),
        "errors": dict(Counter(e for _, _, e in load.errors)),
        "tokens_per_s": sum(r.completion_tokens for _, _, r in load.answers) / elapsed,
        "ttft_p50_s": median(ttfts) if ttfts else float("nan"),
        "ttft_p99_s": percentile(ttfts, 0.99),
        "kv_share": sum(r.cached_tokens > 0 for _, _, r in load.answers) / max(1, len(load.answers)),
        "answers_by_replica": dict(Counter(r.replica for _, _, r in load.answers)),
        "load_avg_1m_end": os.getloadavg()[0],
    }


class Failover:
    """Kills the replica with the most users `kill_after_s` into the load (`kill`, started beside
    `Load.run`), then reads what its users saw from the load's record (`report`)."""

    def __init__(self, state: ClusterState, homes: dict[str, str], kill_after_s: float) -> None:
        self.victim = next(r for r in state.replicas if r.id == Counter(homes.values()).most_common(1)[0][0])
        self.moved = sorted(u for u, h in homes.items() if h == self.victim.id)
        self.kill_after_s = kill_after_s
        self.killed_at = float("inf")

    def kill(self) -> None:
        time.sleep(self.kill_after_s)
        os.kill(self.victim.pid, signal.SIGKILL)
        self.killed_at = time.monotonic()

    def report(self, load: Load) -> dict:
        killed = self.killed_at
        failed = [e for e in load.errors if e[0] >= killed]
        back, first_kv, kv_again = {}, {}, {}
        for t, user, reply in sorted(load.answers, key=lambda a: a[0]):
            if user not in self.moved or t < killed or reply.replica == self.victim.id:
                continue
            if user not in back:
                back[user] = t - killed
                first_kv[user] = reply.cached_tokens > 0
            if user not in kv_again and reply.cached_tokens > 0:
                kv_again[user] = t - killed
        return {
            "victim": self.victim.id,
            "moved_users": self.moved,
            "requests_failed_after_kill": len(failed),
            "failed_by_type": dict(Counter(e for _, _, e in failed)),
            "served_again_s": back,
            "served_again_max_s": max(back.values()) if len(back) == len(self.moved) else None,
            "first_answers": len(first_kv),
            "first_answers_from_kv": sum(first_kv.values()),
            "served_from_kv_again_s": kv_again,
            "served_from_kv_again_max_s": max(kv_again.values())
            if len(kv_again) == len(self.moved)
            else None,
        }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.cluster.cluster_load", description=__doc__.splitlines()[0]
    )
    p.add_argument("--levels", type=int, nargs="+", default=[1, 2, 3], help="replica counts, in turn")
    p.add_argument("--clients", type=int, default=6)
    p.add_argument("--users", type=int, default=6)
    p.add_argument("--duration-s", type=float, default=30.0, help="per level")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--memories", type=int, default=8)
    p.add_argument("--words", type=int, default=60)
    p.add_argument("--failover", action="store_true", help="kill a replica under load at the largest level")
    p.add_argument("--serve-args", default="", help="more `kvmem serve` flags for every replica")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    loadavg_start = list(os.getloadavg())
    texts = memory_texts(args.memories, args.words)
    users = [f"cl-user-{i}" for i in range(args.users)]
    serve = ["--no-auth", "--no-store-turns", "--log-level", "warning", "--block-token-budget", "8192",
             "--retrieve-top-k", str(args.memories), *args.serve_args.split()]  # fmt: skip
    rows, failover_row = [], None
    for n in args.levels:
        with tempfile.TemporaryDirectory(prefix="kvmem-cluster-") as tmp:
            root = Path(tmp)
            try:
                state = up(root, n, serve)
                homes = prepare(state, users, texts, args.max_tokens)
                load = Load(state.router_url, users, args.clients, args.max_tokens)
                row = {**level_row(n, load, load.run(args.duration_s)), "homes": homes}
                print(f"# {row}", file=sys.stderr)
                rows.append(row)
                if args.failover and n == max(args.levels) and n >= 2:
                    load = Load(state.router_url, users, args.clients, args.max_tokens)
                    kill = Failover(state, homes, args.duration_s / 3)
                    elapsed = load.run(args.duration_s, during=threading.Thread(target=kill.kill).start)
                    failover_row = {**kill.report(load), **level_row(n, load, elapsed)}
                    print(f"# failover {failover_row}", file=sys.stderr)
            finally:
                down(root)
    result = {
        "benchmark": "cluster_load",
        "command": "python -m benchmarks.cluster.cluster_load "
        + " ".join(sys.argv[1:] if argv is None else argv),
        # loadavg_start: before any replica was spawned (env's `loadavg` is read at the end, with this run's load)
        "env": {**env_info(), "loadavg_start": loadavg_start},
        "router": "haproxy, balance hash on X-Kvmem-User, hash-type consistent (deploy/haproxy.cfg)",
        "rows": rows,
        "failover": failover_row,
    }
    write_outputs(result, args.out)
    return result


if __name__ == "__main__":
    main()

"""Writes/s of the shared PostgreSQL store with 2 replicas and 20 users: one global write lock (the store before
issue 42 item 18) against per-user locks (pg.begin_write now), timed in the same run, the arms alternated.

Starts a PostgreSQL server on loopback (kvmem.text.db.pg_server, as the tests do), then for each round and
arm a fresh database and two replica processes (`--replica`: a MemoryStore over the database, as `kvmem serve
--store postgresql://...` opens it), each writing for its half of the users (the router sends a user to one
replica: here users 0, 2, 4, ... to the first). Every user has one writer thread that alternates what a chat
server writes: a memory added (`add`, as POST /v1/memories) and a chat turn logged (`log_turns`, the user's
message and the reply). Counts writes committed in `--duration-s` after a `--warmup-s`, and each write's
latency. The global arm patches pg.begin_write to take the one exclusive lock it took before, and the
process's write lock to one stripe; the per-user arm runs the store as shipped. The server is the tests' one
(fsync off): a commit costs no disk flush, so the lock's share of a write is larger than on a server with fsync.

    .venv/bin/python -m benchmarks.cluster.write_locks --rounds 3 --duration-s 20 \\
        --out benchmarks/results/cpu/write_locks.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

from benchmarks.common import env_info, median, p90, print_table, write_outputs

ARMS = ("global", "per_user")
REPLICAS = 2


def _old_begin_write(conn, user_id=None) -> None:
    """pg.begin_write before per-user locks: every writer of every replica takes one exclusive lock."""
    from kvmem.text.db import pg

    conn.execute("BEGIN")
    conn.execute("SELECT pg_advisory_xact_lock(?)", (pg.WRITE_LOCK_KEY,))


def replica(url: str, users: list[str], arm: str, warmup_s: float, duration_s: float) -> dict:
    """One replica's writers (a thread per user) for warmup + duration; what committed in the timed window."""
    from kvmem.text import HashEmbedder, MemoryStore
    from kvmem.text.db import connections, pg

    if arm == "global":
        pg.begin_write = _old_begin_write
        connections.WRITE_LOCK_STRIPES = 1
    store = MemoryStore(url, embedder=HashEmbedder())
    start = time.monotonic() + 0.5  # every thread begins together
    timed_from, stop_at = start + warmup_s, start + warmup_s + duration_s
    lock = threading.Lock()
    done: dict[str, list[float]] = {"add": [], "log_turns": []}
    errors: list[str] = []

    def writer(user: str) -> None:
        time.sleep(max(0.0, start - time.monotonic()))
        i = 0
        while (began := time.monotonic()) < stop_at:
            try:
                if i % 2 == 0:
                    store.add(user, f"{user} note {i}: the meeting moved to room {i % 97}")
                    kind = "add"
                else:
                    said = [
                        {"role": "user", "content": f"where is meeting {i}?"},
                        {"role": "assistant", "content": f"room {i % 97}"},
                    ]
                    store.log_turns(user, said)
                    kind = "log_turns"
            except Exception as exc:  # noqa: BLE001 - counted and reported
                with lock:
                    errors.append(type(exc).__name__)
                continue
            finally:
                i += 1
            ended = time.monotonic()
            if began >= timed_from and ended <= stop_at:
                with lock:
                    done[kind].append(ended - began)

    threads = [threading.Thread(target=writer, args=(u,)) for u in users]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    store.close()
    return {"latencies_s": done, "errors": errors}


def run_arm(server, name: str, arm: str, num_users: int, warmup_s: float, duration_s: float) -> dict:
    """Two replica processes over a fresh database; their writes summed."""
    url = server.create_database(name)
    from kvmem.text import HashEmbedder, MemoryStore

    MemoryStore(url, embedder=HashEmbedder()).close()  # migrated once, before the replicas open it
    users = [f"user{u:02d}" for u in range(num_users)]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "benchmarks.cluster.write_locks",
                "--replica",
                url,
                "--arm",
                arm,
                "--replica-users",
                ",".join(users[r::REPLICAS]),
                "--warmup-s",
                str(warmup_s),
                "--duration-s",
                str(duration_s),
            ],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        for r in range(REPLICAS)
    ]
    outs = [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in procs]
    assert all(p.returncode == 0 for p in procs), [p.returncode for p in procs]
    lat = {k: [x for o in outs for x in o["latencies_s"][k]] for k in ("add", "log_turns")}
    every = lat["add"] + lat["log_turns"]
    return {
        "arm": arm,
        "writes": len(every),
        "writes_per_s": len(every) / duration_s,
        "adds_per_s": len(lat["add"]) / duration_s,
        "turn_logs_per_s": len(lat["log_turns"]) / duration_s,
        "write_p50_ms": 1000 * median(every) if every else float("nan"),
        "write_p90_ms": 1000 * p90(every) if every else float("nan"),
        "errors": [e for o in outs for e in o["errors"]],
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--users", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3, help="each round times both arms, in alternating order")
    ap.add_argument("--duration-s", type=float, default=20.0)
    ap.add_argument("--warmup-s", type=float, default=2.0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--replica", default=None, help=argparse.SUPPRESS)  # a replica process: its database
    ap.add_argument("--arm", choices=ARMS, default="per_user", help=argparse.SUPPRESS)
    ap.add_argument("--replica-users", default="", help=argparse.SUPPRESS)  # its users, comma-separated
    args = ap.parse_args(argv)
    if args.replica is not None:
        users = args.replica_users.split(",")
        print(json.dumps(replica(args.replica, users, args.arm, args.warmup_s, args.duration_s)))
        return
    from kvmem.text.db.pg_server import start_server

    env = env_info("cpu")  # before the replicas start: the machine's own load (loadavg_end: with this run's)
    server = start_server()
    rows = []
    try:
        for r in range(args.rounds):
            order = ARMS if r % 2 == 0 else ARMS[::-1]
            for arm in order:
                row = run_arm(server, f"wl_{r}_{arm}", arm, args.users, args.warmup_s, args.duration_s)
                rows.append({"round": r, **row})
                print(f"round {r} {arm}: {row['writes_per_s']:.1f} writes/s", file=sys.stderr)
    finally:
        server.close()
    summary = {}
    for arm in ARMS:
        mine = [row for row in rows if row["arm"] == arm]
        summary[arm] = {
            "writes_per_s_median": median([row["writes_per_s"] for row in mine]),
            "write_p50_ms_median": median([row["write_p50_ms"] for row in mine]),
            "write_p90_ms_median": median([row["write_p90_ms"] for row in mine]),
        }
    speedup = summary["per_user"]["writes_per_s_median"] / max(summary["global"]["writes_per_s_median"], 1e-9)
    print_table(
        ["arm", "writes/s (median)", "p50 ms", "p90 ms"],
        [
            [arm, s["writes_per_s_median"], s["write_p50_ms_median"], s["write_p90_ms_median"]]
            for arm, s in summary.items()
        ],
    )
    print(f"per-user / global writes/s: {speedup:.2f}x", file=sys.stderr)
    result = {
        "benchmark": "write_locks",
        "config": {
            "replicas": REPLICAS,
            "users": args.users,
            "rounds": args.rounds,
            "duration_s": args.duration_s,
            "warmup_s": args.warmup_s,
            "writes": "per user one thread alternating store.add and store.log_turns (user + reply)",
        },
        "env": {**env, "loadavg_end": list(os.getloadavg())},
        "rows": rows,
        "summary": summary,
        "per_user_over_global": speedup,
    }
    write_outputs(result, args.out)


if __name__ == "__main__":
    main()

"""`kvmem build` over a data dir of N users x M memories: build throughput, bytes, and the resume time when
nothing changed (everything verifies; the weights must not be loaded).

    python -m benchmarks.tiers.offline_build --users 30 --memories 20 --out benchmarks/results/cpu/offline_build.json

Each arm runs the real command line (`python -m serving.ops.build_cli`) in a subprocess, so the wall times
include Python start-up and imports. The data dir is seeded with the plaintext store only (no heat): every
user's block is the policy's choice over equally hot memories. `--extrapolate-to` scales the measured
per-user times linearly, labelled as such in the JSON.

`--data-dir DIR` keeps the data dir (created and seeded when it does not exist) so the resume can be measured
again later on its own, e.g. on a quiet machine: `--data-dir DIR --resume-only` runs only the resumed build
(nothing changed) and reads the users, memories and bytes from DIR.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import env_info, print_table, write_outputs

TOPICS = ["cooking", "cycling", "jazz", "chess", "gardening", "astronomy", "pottery", "hiking", "sailing"]


def memory_text(u: int, i: int) -> str:
    topic = TOPICS[(u + i) % len(TOPICS)]
    return f"User {u} mentioned on day {i} that they enjoy {topic} and want to learn more about it soon."


def seed(data: Path, users: int, memories: int) -> None:
    from kvmem.text import MemoryStore

    with MemoryStore(data / "memories.sqlite") as store:
        for u in range(users):
            store.add(f"user{u:05d}", texts=[memory_text(u, i) for i in range(memories)])


def run_build(data: Path, model: str | None) -> tuple[float, str]:
    cmd = [sys.executable, "-m", "serving.ops.build_cli", "--data-dir", str(data), "--no-progress"]
    if model:
        cmd += ["--model", model]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"kvmem build failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return wall, proc.stderr.strip().splitlines()[-1]


def count_users(data: Path) -> int:
    from kvmem.text import MemoryStore

    with MemoryStore(data / "memories.sqlite") as store:
        return len(store.count_by_user())


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--users", type=int, default=30)
    ap.add_argument("--memories", type=int, default=20)
    ap.add_argument("--model", default=None)
    ap.add_argument("--extrapolate-to", type=int, default=1000)
    ap.add_argument("--data-dir", default=None, help="keep the data dir here (seeded when absent)")
    ap.add_argument("--resume-only", action="store_true", help="only the resumed build over --data-dir")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.resume_only and (args.data_dir is None or not Path(args.data_dir).is_dir()):
        raise SystemExit("--resume-only needs --data-dir naming a data dir a previous run built")
    env = env_info("cpu")
    with contextlib.ExitStack() as stack:
        if args.data_dir is None:
            data = (
                Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvmem-offline-build-"))) / "data"
            )
        else:
            data = Path(args.data_dir)
        if args.resume_only:
            resume_s, resume_line = run_build(data, args.model)
            result = {
                "env": env,
                "loadavg_after": list(os.getloadavg()),
                "resume_only": True,
                "users": count_users(data),
                "kv_bytes": dir_bytes(data / "kv"),
                "resume_s": round(resume_s, 2),
                "resume_line": resume_line,
                "resume_loaded_model": "(model loaded)" in resume_line,
            }
            print_table(
                ["users", "MB on disk", "resume s", "resume loads model"],
                [
                    [
                        result["users"],
                        round(result["kv_bytes"] / 1e6, 1),
                        result["resume_s"],
                        result["resume_loaded_model"],
                    ]
                ],
            )
            write_outputs(result, args.out)
            return
        t0 = time.perf_counter()
        seed(data, args.users, args.memories)
        seed_s = time.perf_counter() - t0
        build_s, build_line = run_build(data, args.model)
        kv_bytes = dir_bytes(data / "kv")
        resume_s, resume_line = run_build(data, args.model)
    n, scale = args.users, args.extrapolate_to / args.users
    result = {
        "env": env,
        "loadavg_after": list(os.getloadavg()),
        "users": n,
        "memories_per_user": args.memories,
        "model": args.model or "default",
        "seed_store_s": round(seed_s, 2),
        "build_s": round(build_s, 2),
        "build_line": build_line,
        "items_per_s": round(n / build_s, 3),
        "kv_bytes": kv_bytes,
        "kv_bytes_per_user": kv_bytes // n,
        "resume_s": round(resume_s, 2),
        "resume_line": resume_line,
        "resume_loaded_model": "(model loaded)" in resume_line,
        "extrapolated": {
            "note": f"linear in users from the measured {n}; NOT measured",
            "users": args.extrapolate_to,
            "build_s": round(build_s * scale, 1),
            "kv_bytes": int(kv_bytes * scale),
            "resume_s_upper": round(resume_s * scale, 1),
        },
    }
    print_table(
        ["users", "mem/user", "build s", "items/s", "MB on disk", "resume s", "resume loads model"],
        [
            [
                n,
                args.memories,
                result["build_s"],
                result["items_per_s"],
                round(kv_bytes / 1e6, 1),
                result["resume_s"],
                result["resume_loaded_model"],
            ]
        ],
    )
    write_outputs(result, args.out)


if __name__ == "__main__":
    main()

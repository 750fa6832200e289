"""`kvmem build`'s command line: flags, model and store set-up, exit codes (0 ok, 1 a line, a user or the job
failed, 2 bad arguments). Without `--input`, every user's block as the server will serve it; with it, the
lines' blocks (both jobs: serving.ops.offline_build). The weights load only when a block
must be prefilled (kvmem.kv.lazy_model)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvmem.datadir import DataDir
from kvmem.errors import KvmemError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvmem build", description="Build users' KV memory blocks offline.")
    p.add_argument(
        "--input",
        default=None,
        help="JSON-lines file, one user block per line (default: every user of the data dir)",
    )
    who = p.add_mutually_exclusive_group()
    who.add_argument("--users", default=None, help="without --input: a file of user ids, one per line")
    who.add_argument("--user-id", default=None, help="without --input: this user only")
    p.add_argument(
        "--knowledge",
        default=None,
        help="install these shared texts (one per line, or JSONL) as every block's head, build them once",
    )
    p.add_argument(
        "--model", default=None, help="model alias, local dir, .gguf file or HF id (default: SmolLM2)"
    )
    p.add_argument("--data-dir", default=None, help="data dir (default ./.kvmem)")
    p.add_argument(
        "--store",
        default=None,
        help="the memory store, as `kvmem serve --store`: postgresql://user@host:port/db or a SQLite file "
        "(default: DATA_DIR/memories.sqlite)",
    )
    p.add_argument(
        "--block-token-budget", type=int, default=2048, help="as `kvmem serve`'s (the blocks it will serve)"
    )
    p.add_argument(
        "--kv-user-mb",
        type=int,
        default=None,
        help="as `kvmem serve`'s: no user's block is built bigger than this quota (default: no quota)",
    )
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="where the model runs (default auto: cuda when a GPU is visible, else cpu)",
    )
    p.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16", "float16"),
        default="auto",
        help="model dtype (default auto: bfloat16 on a GPU that supports it, else float32); the server "
        "serves only items built at its own dtype",
    )
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--recheck",
        action="store_true",
        help="check every user's block even when nothing changed since the last complete build (by default "
        "that case returns at once: nothing to build, no model or tokenizer loaded)",
    )
    return p


def _users(args: argparse.Namespace) -> list[str] | None:
    if args.user_id is not None:
        return [args.user_id]
    if args.users is not None:
        return [u.strip() for u in Path(args.users).read_text().splitlines() if u.strip()]
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)  # exits 2 on bad arguments
    if args.input is not None and not Path(args.input).is_file():
        print(f"kvmem build: input file {args.input!r} does not exist", file=sys.stderr)
        return 2
    if args.input is not None and (args.users or args.user_id):
        print("kvmem build: --users and --user-id go without --input", file=sys.stderr)
        return 2
    if args.knowledge is not None and not Path(args.knowledge).is_file():
        print(f"kvmem build: knowledge file {args.knowledge!r} does not exist", file=sys.stderr)
        return 2
    if args.users is not None and not Path(args.users).is_file():
        print(f"kvmem build: users file {args.users!r} does not exist", file=sys.stderr)
        return 2
    if args.block_token_budget < 0:
        print("kvmem build: --block-token-budget must be >= 0", file=sys.stderr)
        return 2
    if args.kv_user_mb is not None and args.kv_user_mb < 1:
        print(f"kvmem build: --kv-user-mb must be >= 1 (MiB), got {args.kv_user_mb}", file=sys.stderr)
        return 2
    if args.store is not None:
        from kvmem.text.db.dialect import check_store_location

        try:
            check_store_location(args.store)
        except ValueError as exc:
            print(f"kvmem build: --store: {exc}", file=sys.stderr)
            return 2
    from serving.ops import build_stamp

    try:
        data_dir = DataDir.at(args.data_dir)
        users_wanted = _users(args)
    except (KvmemError, OSError) as exc:
        print(f"kvmem build: {exc}", file=sys.stderr)
        return 1
    # what the fast path covers (it reads the data dir's SQLite store and heat: not a --store elsewhere)
    every_user = args.input is None and args.knowledge is None and args.store is None
    settings = {
        "model": args.model,
        "device": args.device,
        "dtype": args.dtype,
        "block_token_budget": args.block_token_budget,
        "kv_user_mb": args.kv_user_mb,
        "users": users_wanted,
    }
    if every_user and not args.recheck:
        last = build_stamp.unchanged_since_last(data_dir, settings)
        if last is not None:
            print(
                f"kvmem build: nothing changed since the last build ({last['finished_at']}, "
                f"{last['num_users']} users): nothing to build (--recheck checks every block again)",
                file=sys.stderr,
            )
            return 0
    before = build_stamp.inputs(data_dir, settings) if every_user else None
    from kvmem.models import resolve_device  # torch: seconds

    try:
        device = str(resolve_device(args.device))  # resolved here: the lazy handle's `.device` loads weights
    except KvmemError as exc:
        print(f"kvmem build: --device {args.device}: {exc}", file=sys.stderr)
        return 2
    print("kvmem build: loading the tokenizer and the data dir's store", file=sys.stderr, flush=True)
    from kvmem.kv import knowledge
    from kvmem.kv.blocks import BlockBuilder
    from kvmem.kv.layout import PromptLayout
    from kvmem.kv.lazy_model import LazyHandle
    from kvmem.kv.store import KVStoreConfig, TieredKVStore
    from serving.ops.offline_build import OfflinePlanner, run_build, run_users

    planner = None
    try:
        if args.knowledge is not None:  # parsed before anything is installed: a bad file changes nothing
            knowledge.install(data_dir.root, knowledge.parse_knowledge_file(args.knowledge))
        handle = LazyHandle(
            args.model,
            device=device,
            dtype=args.dtype,
            cache_file=data_dir.root / "build" / "fingerprints.json",
        )
        store = TieredKVStore(
            KVStoreConfig(directory=str(data_dir.kv_dir), device=device, device_bytes=0, host_bytes=0),
            handle.fingerprint,
        )
        layout = PromptLayout(handle.tokenizer, knowledge=knowledge.installed(data_dir.root))
        builder = BlockBuilder(handle, layout, store)
        if args.knowledge is not None:
            knowledge.ensure_knowledge_item(handle, layout, store)
        planner = OfflinePlanner(
            data_dir,
            builder,
            block_token_budget=args.block_token_budget,
            kv_user_mb=args.kv_user_mb,
            store=args.store,
        )
        progress = not args.no_progress
        if args.input is not None:
            report = run_build(args.input, builder, data_dir=data_dir, planner=planner, progress=progress)
            built, skipped, failed, ok = report.built, report.skipped, len(report.failed), report.ok
            extra = f"; added {report.added} memories to the store" if report.added else ""
        else:
            users = run_users(planner, users_wanted, progress=progress)
            built, skipped, failed, ok = users.built, users.skipped, len(users.failed), not users.failed
            extra = f"; {users.no_block} users get no block (policy)" if users.no_block else ""
            if ok and before is not None:
                build_stamp.record(data_dir, before, built + skipped + users.no_block)
            else:
                build_stamp.forget(data_dir)
    except (KvmemError, OSError) as exc:
        print(f"kvmem build: {exc}", file=sys.stderr)
        return 1
    finally:
        if planner is not None:
            planner.close()
    loaded = "model loaded" if handle.loaded else "model not loaded"
    print(
        f"built {built}, skipped {skipped} (already valid), failed {failed}{extra} ({loaded})",
        file=sys.stderr,
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

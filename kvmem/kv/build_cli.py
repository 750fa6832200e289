"""`kvmem build`'s command line: flags, model and store set-up, exit codes (0 ok, 1 a line or the job
failed, 2 bad arguments). The job itself is kvmem.kv.build_job."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvmem.datadir import DataDir
from kvmem.errors import KvmemError
from kvmem.kv.build_job import run_build


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvmem build", description="Build users' KV memory blocks offline.")
    p.add_argument("--input", required=True, help="JSON-lines file, one user block per line")
    p.add_argument(
        "--model", default=None, help="model alias, local dir, .gguf file or HF id (default: SmolLM2)"
    )
    p.add_argument("--data-dir", default=None, help="data dir (default ./.kvmem)")
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
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)  # exits 2 on bad arguments
    if not Path(args.input).is_file():
        print(f"kvmem build: input file {args.input!r} does not exist", file=sys.stderr)
        return 2
    from kvmem.kv.blocks import BlockBuilder
    from kvmem.kv.layout import PromptLayout
    from kvmem.kv.store import KVStoreConfig, TieredKVStore
    from kvmem.models import load_model, resolve_device

    try:
        resolve_device(args.device)
    except KvmemError as exc:
        print(f"kvmem build: --device {args.device}: {exc}", file=sys.stderr)
        return 2
    try:
        data_dir = DataDir.at(args.data_dir)
        handle = load_model(args.model, device=args.device, dtype=args.dtype)
        store = TieredKVStore(
            KVStoreConfig(
                directory=str(data_dir.kv_dir), device=str(handle.device), device_bytes=0, host_bytes=0
            ),
            handle.fingerprint,
        )
        builder = BlockBuilder(handle, PromptLayout(handle.tokenizer), store)
        report = run_build(args.input, builder, data_dir=data_dir, progress=not args.no_progress)
    except KvmemError as exc:
        print(f"kvmem build: {exc}", file=sys.stderr)
        return 1
    print(
        f"built {report.built}, skipped {report.skipped} (already valid), failed {len(report.failed)}",
        file=sys.stderr,
    )
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())

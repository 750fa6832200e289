"""Loading a KV item from disk (verified) versus recomputing it by prefill, for 0.5k / 2k / 6k-token blocks.

    python -m benchmarks.tiers.kv_load --out out/kv_load.json [--sizes 500 2000 6000] [--reps 3]

Load is timed from a file already in the page cache (what a warm host sees), with and without the SHA-256
verification; recompute is `build_item` (one prefill of the block).
"""

from __future__ import annotations

import argparse
import sys
import tempfile

from benchmarks.common import env_info, median, print_table, timed, write_outputs
from benchmarks.ttft.memos_grid import memories_for
from kvmem.kv import PromptLayout, build_item
from kvmem.kv.io import load_item, save_item


def run(handle, sizes, reps: int, device: str) -> list[dict]:
    layout = PromptLayout(handle.tokenizer)
    fp = handle.fingerprint
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in sizes:
            block = layout.block_ids(memories_for(layout, size, seed=size))
            build = [
                timed(lambda b=block: build_item(handle, b, user_id="bench"), device) for _ in range(reps)
            ]
            item = build[-1][1]
            save_s, _ = timed(lambda it=item: save_item(it, tmp), device)
            load_item(tmp, item.item_id, fp, device=device)  # warm the page cache
            verified = [
                timed(lambda it=item: load_item(tmp, it.item_id, fp, device=device), device)[0]
                for _ in range(reps)
            ]
            fast = [
                timed(
                    lambda it=item: load_item(tmp, it.item_id, fp, device=device, verify_checksum=False),
                    device,
                )[0]
                for _ in range(reps)
            ]
            recompute_s = median([b[0] for b in build])
            row = {
                "block_tokens": len(block),
                "num_bytes": item.meta.num_bytes,
                "recompute_s": recompute_s,
                "save_s": save_s,
                "load_verified_s": median(verified),
                "load_unverified_s": median(fast),
                "speedup_x": recompute_s / median(verified),
            }
            rows.append(row)
            print(f"# {row}", file=sys.stderr)
    return rows


def main(argv: list[str] | None = None, handle=None) -> dict:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.tiers.kv_load", description=__doc__.splitlines()[0]
    )
    p.add_argument("--model", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--sizes", type=int, nargs="+", default=[500, 2000, 6000])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if handle is None:
        from kvmem.models import load_model

        handle = load_model(args.model, device=args.device, dtype=args.dtype)
    rows = run(handle, args.sizes, args.reps, args.device)
    print_table(
        ["Block tok", "MiB", "Recompute (s)", "Save (s)", "Load+verify (s)", "Load (s)", "Speedup (x)"],
        [
            [
                r["block_tokens"],
                round(r["num_bytes"] / 2**20, 1),
                r["recompute_s"],
                r["save_s"],
                r["load_verified_s"],
                r["load_unverified_s"],
                round(r["speedup_x"], 1),
            ]
            for r in rows
        ],
    )
    result = {"env": {**env_info(args.device), "model": handle.model_id, "reps": args.reps}, "rows": rows}
    write_outputs(result, args.out)
    return result


if __name__ == "__main__":
    main()

"""Exactness of KV injection on any device/dtype: greedy tokens and first-token logit differences against a
full prefill of the same ids (transformers' own forward/generate).

    python -m benchmarks.ttft.exactness --device cuda --dtype bfloat16 --out out/exact_gpu.json

On CPU fp32 the tests require identical tokens; on GPU this script measures the tolerance to state.
"""

from __future__ import annotations

import argparse
import sys

import torch

from benchmarks.common import env_info, print_table, write_outputs
from benchmarks.ttft.memos_grid import memories_for, query_for
from benchmarks.ttft.ttft_grid import reference_tokens
from kvmem.kv import PromptLayout, Sampling, build_item, generate, inject


def first_logits(model, ids, item, device):
    with torch.inference_mode():
        if item is None:
            out = model(input_ids=torch.tensor([ids], device=device), logits_to_keep=1)
        else:
            inj = inject(item, ids)
            n = inj.reused_tokens
            out = model(
                input_ids=torch.tensor([ids[n:]], device=device),
                past_key_values=inj.cache,
                use_cache=True,
                cache_position=torch.arange(n, len(ids), device=device),
                logits_to_keep=1,
            )
    return out.logits[0, -1].float()


def run(handle, sizes, queries, new_tokens: int, device: str) -> list[dict]:
    layout = PromptLayout(handle.tokenizer)
    rows = []
    for size in sizes:
        memories = memories_for(layout, size, seed=size)
        item = build_item(handle, layout.block_ids(memories), user_id="bench")
        before = item.kv.clone()
        for q in queries:
            ids = list(layout.prompt(memories, [], query_for(layout, memories, q, seed=q)).ids)
            ours = list(generate(handle.model, ids, item=item, sampling=Sampling(max_new_tokens=new_tokens)))
            ref = reference_tokens(handle.model, ids, new_tokens, device)
            a, b = (
                first_logits(handle.model, ids, item, device),
                first_logits(handle.model, ids, None, device),
            )
            agree = next((i for i, (x, y) in enumerate(zip(ours, ref, strict=True)) if x != y), len(ref))
            rows.append(
                {
                    "ctx_tokens": item.num_tokens,
                    "query_tokens": len(ids) - item.num_tokens,
                    "identical": ours == ref,
                    "tokens_agreeing": agree,
                    "new_tokens": new_tokens,
                    "max_abs_logit_diff": float((a - b).abs().max()),
                    "top1_same": int(a.argmax()) == int(b.argmax()),
                }
            )
            print(f"# {rows[-1]}", file=sys.stderr)
        assert torch.equal(before, item.kv), "stored KV was modified"
    return rows


def main(argv: list[str] | None = None, handle=None) -> dict:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.ttft.exactness", description=__doc__.splitlines()[0]
    )
    p.add_argument("--model", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--sizes", type=int, nargs="+", default=[500, 2000, 6000])
    p.add_argument("--queries", type=int, nargs="+", default=[20, 150, 950])
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if handle is None:
        from kvmem.models import load_model

        handle = load_model(args.model, device=args.device, dtype=args.dtype)
    rows = run(handle, args.sizes, args.queries, args.new_tokens, args.device)
    print_table(
        ["Ctx tok", "Qry tok", "Identical", "Agreeing", "Max |dlogit|", "Top-1 same"],
        [
            [
                r["ctx_tokens"],
                r["query_tokens"],
                r["identical"],
                f"{r['tokens_agreeing']}/{r['new_tokens']}",
                f"{r['max_abs_logit_diff']:.2e}",
                r["top1_same"],
            ]
            for r in rows
        ],
    )
    result = {
        "env": {**env_info(args.device), "model": handle.model_id, "dtype": str(handle.dtype)},
        "rows": rows,
    }
    write_outputs(result, args.out)
    return result


if __name__ == "__main__":
    main()

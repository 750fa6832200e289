"""How often bfloat16 greedy tokens agree with float32's through the engine (issue 43 item 2: "bf16 agreement
measured and stated"), on the fast path (serving/engine/models) and on the generic one.

--requests requests (blocks of memory KV of different lengths injected, and none; questions of different
lengths) run batched through the engine's steps (admit + runner.step, prefill in chunks of --chunk tokens,
arriving one per step) for --tokens greedy tokens each: once in float32 (the reference, fast path), then in
bfloat16 on the fast path and on the generic path. Counts per bf16 arm: requests whose tokens are all equal to
float32's (and to the other bf16 path's), tokens equal before the first difference (out of all), and at each first difference float32's top-2
logit gap there (alone: the reference request prefilled and decoded to that point; a near-tie if < --near-tie).
Counts, not timings: they can be taken on a busy machine. Last line of stdout: the JSON written to --out (git
sha and load average in `env`).

    python -m benchmarks.engine.bf16_agreement --out benchmarks/results/cpu/bf16_agreement.json
"""

from __future__ import annotations

import argparse
import copy

import torch

from benchmarks.common import env_info, print_table, write_outputs
from benchmarks.ttft.memos_grid import memories_for
from kvmem.kv import PromptLayout, Sampling, build_item
from kvmem.models import handle_for, load_model
from serving.engine import models, runner
from serving.engine.pages import PagePool, PoolShape
from serving.engine.sequence import admit

QUESTIONS = (
    "Hi",
    "Where do I live?",
    "Which city did I mention, and what did I cook on Tuesday?",
    "Summarize what you know about me in one sentence, then list three things I should do this weekend.",
)
BLOCKS = (None, 120, 400, 900)  # memory tokens of each request's block (None: no block)


def workload(layout: PromptLayout, n: int) -> list[tuple[list[int], list[str] | None]]:
    """(prompt ids, its memories or None) of `n` requests: blocks of different lengths and none, questions of
    different lengths."""
    out = []
    for i in range(n):
        size, question = BLOCKS[i % len(BLOCKS)], QUESTIONS[(i // len(BLOCKS) + i) % len(QUESTIONS)]
        memories = memories_for(layout, size, seed=i) if size else []
        ids = layout.prompt(memories, [], [{"role": "user", "content": question}]).ids
        out.append((ids, memories or None))
    return out


def run(handle, requests, tokens: int, chunk: int) -> list[list[int]]:
    """Every request's greedy tokens, batched through the engine (one arriving per step)."""
    model, layout = handle.model, PromptLayout(handle.tokenizer)
    items = [build_item(handle, layout.block_ids(m), user_id="bench") if m else None for _, m in requests]
    pool = PagePool(PoolShape.of_model(model), 256 << 20)
    sp = Sampling(max_new_tokens=tokens)
    seqs, step = [], 0
    with torch.inference_mode():
        while len(seqs) < len(requests) or any(not s.finished for s in seqs):
            if step < len(requests):
                ids, _ = requests[step]
                *_, seq = admit(
                    pool, model, ids, item=items[step], max_new_tokens=tokens, sampling=sp,
                    prefill_chunk_tokens=chunk,
                )  # fmt: skip
                seqs.append(seq)
            runner.step(model, pool, [s for s in seqs if s.prefilling], [s for s in seqs if s.decoding])
            step += 1
    out = [list(s.stats.token_ids) for s in seqs]
    for s in seqs:
        s.release()
    return out


def top2_gap(model, ids: list[int]) -> float:
    """float32's top-2 logit gap after `ids` (a full forward: the reference's own logits there)."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids]), logits_to_keep=1).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def compare(reference, handle32, requests, got, near_tie: float) -> dict:
    same = sum(a == b for a, b in zip(reference, got, strict=True))
    agreeing, total, firsts = 0, 0, []
    for (ids, _), a, b in zip(requests, reference, got, strict=True):
        k = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        agreeing += k
        total += len(a)
        if a != b and k < min(len(a), len(b)):
            gap = top2_gap(handle32.model, [*ids, *a[:k]])
            firsts.append({"index": k, "fp32_top2_gap": gap, "near_tie": gap < near_tie})
    return {
        "requests_identical": same,
        "requests": len(reference),
        "tokens_before_first_difference": agreeing,
        "tokens": total,
        "first_differences": firsts,
        "near_ties": sum(f["near_tie"] for f in firsts),
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--near-tie", type=float, default=0.1, help="a top-2 logit gap below this is a near-tie")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    env = env_info("cpu")
    h32 = load_model(args.model, device="cpu", dtype="float32")
    requests = workload(PromptLayout(h32.tokenizer), args.requests)
    assert models.enable(h32.model).path == "fast"
    reference = run(h32, requests, args.tokens, args.chunk)
    models.disable(h32.model)
    m16 = copy.deepcopy(h32.model).to(torch.bfloat16)
    h16 = handle_for(m16, h32.tokenizer, model_id=h32.model_id)
    arms, tokens16 = {}, {}
    for path in ("fast", "generic"):
        if path == "fast":
            assert models.enable(m16).path == "fast"
        else:
            models.disable(m16)
        tokens16[path] = run(h16, requests, args.tokens, args.chunk)
        arms[path] = compare(reference, h32, requests, tokens16[path], args.near_tie)
    print_table(
        ["bf16 path", "requests identical", "tokens before 1st diff", "first diffs at near-ties"],
        [
            [
                k,
                f"{a['requests_identical']}/{a['requests']}",
                f"{a['tokens_before_first_difference']}/{a['tokens']}",
                f"{a['near_ties']}/{len(a['first_differences'])}",
            ]
            for k, a in arms.items()
        ],  # fmt: skip
    )
    result = {
        "env": env,
        "model": h32.model_id,
        "args": vars(args),
        "reference": "float32, fast path",
        "bf16": arms,
        # requests whose bf16 tokens are the same on both paths (the fast layers' own rounding in bf16)
        "bf16_fast_equals_generic": sum(
            a == b for a, b in zip(tokens16["fast"], tokens16["generic"], strict=True)
        ),
    }
    write_outputs(result, args.out)
    return result


if __name__ == "__main__":
    main()

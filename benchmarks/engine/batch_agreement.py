"""How far a batched decode step's logits are from the same step run alone (real model, CPU fp32).

Measured on the per-request-cache design the engine replaced (benchmarks/engine/percache/, the baseline of the
engine's figures); the engine's own batched-vs-alone agreement is engine_bench's part 3.

A batch computes the linear layers with other matrix kernels than one row alone (MKL picks them by the
number of rows), so logits agree to within rounding, not bit for bit; attention is ragged and runs the call
it runs alone. For N requests (blocks of different lengths, none, prompts of different lengths) decoding
together, each step compares every row's batched logits with that row's step alone on the same cache, and
the whole greedy outputs batched with those alone. Then the same for packed steps (benchmarks/engine/percache/packed.py):
the requests arrive two per step and prefill in chunks of --chunk tokens packed into one forward with the others'
decode steps; every segment's logits at its last position are compared with that chunk or step alone on the
same cache, and the greedy outputs with each request alone (same chunks). Last line of stdout: the JSON
written to --out.

    python -m benchmarks.engine.batch_agreement --requests 8 --tokens 32 --out benchmarks/results/cpu/batch_agreement.json
"""

from __future__ import annotations

import argparse

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from benchmarks.common import env_info, print_table, write_outputs
from benchmarks.engine.percache.batch import CacheSequence, _forward_one, _forward_ragged
from benchmarks.engine.percache.packed import _forward_packed, commit, segments_of
from benchmarks.load.http_client import memory_texts
from kvmem.kv import PromptLayout, Sampling, build_item
from kvmem.kv.sampling import pick
from kvmem.models import load_model

QUESTIONS = (
    "Hi",
    "Which city did I mention, and what did I cook on Tuesday?",
    "Summarize what you know about me in one sentence.",
    "What should I do this weekend? Give me three ideas based on my plans.",
)


def shallow_copy(cache: DynamicCache) -> DynamicCache:
    """A cache over the same tensors: an update concatenates into new ones, so the original is untouched."""
    layers = []
    for src in cache.layers:
        layer = DynamicLayer()
        layer.dtype, layer.device, layer.is_initialized = src.dtype, src.device, True
        layer.keys, layer.values = src.keys, src.values
        layers.append(layer)
    copy = DynamicCache()
    copy.layers = layers
    return copy


def logits_alone(seq: CacheSequence) -> torch.Tensor:
    """The logits its next chunk or decode step gets alone, on a copy of its cache (the sequence unchanged)."""
    copy = CacheSequence.__new__(CacheSequence)
    copy.__dict__.update(seq.__dict__)
    copy.cache = shallow_copy(seq.cache)
    if not seq.prefilling:
        return _forward_one(copy)
    n = seq.next_chunk_tokens()
    out = seq.model(
        input_ids=torch.tensor([seq._prefill[:n]], dtype=torch.long, device=seq.device),
        past_key_values=copy.cache,
        use_cache=True,
        cache_position=torch.arange(seq.position, seq.position + n, device=seq.device),
        logits_to_keep=1,
    )
    return out.logits[0, -1].float()


def run_alone(model, ids, item, sampling, chunk: int | None = None) -> list[int]:
    """One request's greedy tokens, every prefill chunk and decode step alone (the reference)."""
    seq = CacheSequence(model, ids, item=item, sampling=sampling, prefill_chunk_tokens=chunk)
    while seq.prefilling:
        seq.prefill_step()
    with torch.inference_mode():
        while seq.decoding:
            row = _forward_one(seq)
            seq.position += 1
            seq._accept(pick(row, sampling, None))
    return seq.stats.token_ids


def packed_agreement(model, requests, sampling, chunk: int) -> dict:
    """Requests arrive two per step; each step is one packed forward of every chunk and decode step."""
    alone = [run_alone(model, ids, item, sampling, chunk) for ids, item in requests]
    seqs: list[CacheSequence] = []
    max_abs, same_top1, segments_compared, chunks_compared, mixed_steps = 0.0, 0, 0, 0, 0
    with torch.inference_mode():
        while len(seqs) < len(requests) or any(not s.finished for s in seqs):
            for ids, item in requests[len(seqs) : len(seqs) + 2]:
                seqs.append(
                    CacheSequence(model, ids, item=item, sampling=sampling, prefill_chunk_tokens=chunk)
                )
            live = [s for s in seqs if s.prefilling] + [s for s in seqs if s.decoding]
            ref = [logits_alone(s) for s in live]
            segments = segments_of(live)
            mixed_steps += int(any(g.prefill for g in segments) and not all(g.prefill for g in segments))
            packed = _forward_packed(model, segments)
            for g, a, b in zip(segments, ref, packed, strict=True):
                max_abs = max(max_abs, float((a - b).abs().max()))
                same_top1 += int(a.argmax() == b.argmax())
                segments_compared += 1
                chunks_compared += int(g.prefill)
                commit(g, b)
    identical = sum(s.stats.token_ids == a for s, a in zip(seqs, alone, strict=True))
    return {
        "chunk_tokens": chunk,
        "outputs_identical": identical,
        "segments_compared": segments_compared,
        "prefill_chunks_compared": chunks_compared,
        "steps_with_prefill_and_decode": mixed_steps,
        "top1_agreement": same_top1 / segments_compared,
        "max_abs_logit_diff": max_abs,
    }


def main(argv: list[str] | None = None, handle=None) -> dict:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.engine.batch_agreement", description=__doc__.splitlines()[0]
    )
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--model", default=None)
    p.add_argument("--chunk", type=int, default=16, help="prefill chunk tokens of the packed part")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    handle = handle or load_model(args.model, device="cpu", dtype="float32")
    model, layout = handle.model, PromptLayout(handle.tokenizer)
    blocks = [None] + [memory_texts(n, 40, seed=n) for n in (2, 8, 24)]  # blocks of ~100 to ~1.3k tokens
    items = [None] + [build_item(handle, layout.block_ids(m), user_id="u") for m in blocks[1:]]
    requests = []
    for k in range(args.requests):
        mems, item = blocks[k % len(blocks)], items[k % len(items)]
        text = QUESTIONS[k % len(QUESTIONS)] * (1 + k // len(QUESTIONS))
        requests.append((layout.prompt(mems or [], [], [{"role": "user", "content": text}]).ids, item))
    sampling = Sampling(max_new_tokens=args.tokens)

    alone = [run_alone(model, ids, item, sampling) for ids, item in requests]

    seqs = [CacheSequence(model, ids, item=item, sampling=sampling) for ids, item in requests]
    for seq in seqs:
        seq.prefill_step()
    max_abs, same_top1, rows = 0.0, 0, 0
    with torch.inference_mode():
        while any(s.decoding for s in seqs):
            live = [s for s in seqs if s.decoding]
            ref = []
            for s in live:
                copy = CacheSequence.__new__(CacheSequence)
                copy.__dict__.update(s.__dict__)
                copy.cache = shallow_copy(s.cache)
                ref.append(_forward_one(copy))
            batched = _forward_ragged(model, live) if len(live) > 1 else torch.stack([_forward_one(live[0])])
            for s, a, b in zip(live, ref, batched, strict=True):
                max_abs = max(max_abs, float((a - b).abs().max()))
                same_top1 += int(a.argmax() == b.argmax())
                rows += 1
                s.position += 1
                s._accept(pick(b, sampling, None))
    identical = sum(s.stats.token_ids == a for s, a in zip(seqs, alone, strict=True))
    row = {
        "requests": len(requests),
        "tokens_each": args.tokens,
        "prompt_tokens": [len(ids) for ids, _ in requests],
        "block_tokens": [item.num_tokens if item else 0 for _, item in requests],
        "outputs_identical": identical,
        "steps_compared": rows,
        "top1_agreement": same_top1 / rows,
        "max_abs_logit_diff": max_abs,
    }
    print_table(
        [
            "Requests",
            "Tokens each",
            "Outputs identical",
            "Steps compared",
            "Top-1 agreement",
            "Max |logit diff|",
        ],
        [[len(requests), args.tokens, identical, rows, row["top1_agreement"], max_abs]],
    )
    packed = packed_agreement(model, requests, sampling, args.chunk)
    print_table(
        ["Packed: chunk", "Outputs identical", "Segments", "Chunks", "Top-1 agreement", "Max |logit diff|"],
        [
            [
                args.chunk,
                packed["outputs_identical"],
                packed["segments_compared"],
                packed["prefill_chunks_compared"],
                packed["top1_agreement"],
                packed["max_abs_logit_diff"],
            ]
        ],
    )
    result = {"env": {**env_info("cpu"), "model": handle.model_id}, "agreement": row, "packed": packed}
    write_outputs(result, args.out)
    return result


if __name__ == "__main__":
    main()

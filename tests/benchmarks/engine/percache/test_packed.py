"""Packed steps (benchmarks/engine/percache/packed.py): prefill chunks and decode steps of sequences with different prompts and
blocks run as one forward per step, and each sequence gets exactly its tokens alone (decode.generate on a
DynamicCache); the injected items are never written; a failing packed forward puts every cache back and
runs each sequence alone, an error staying with its own sequence; a seeded sampled sequence runs alone."""

from __future__ import annotations

import pytest
import torch

from benchmarks.engine.percache.batch import CacheSequence, SequenceError
from benchmarks.engine.percache.packed import PACKED, step
from kvmem.kv import Sampling, generate
from tests.conftest import prompts_and_blocks

CHUNK = 32


def run_packed(model, requests, samplings, arrive_at, hook=None):
    """CacheSequence k joins at step arrive_at[k]; each step is one `packed.step` of one chunk per prefilling
    sequence and one decode step per decoding one. Returns the sequences, per step ((sequence, chunk tokens)
    of each prefill, the decoding sequences), the input shape of every forward and the errors."""
    seqs: list[CacheSequence] = []
    steps, shapes, errors = [], [], []
    record = model.register_forward_pre_hook(
        lambda _m, _a, kw: shapes.append(tuple(kw["input_ids"].shape)), with_kwargs=True
    )
    try:
        while len(seqs) < len(requests) or any(not s.finished for s in seqs):
            for k, (ids, item) in enumerate(requests):
                if arrive_at[k] == len(steps):
                    seqs.append(
                        CacheSequence(
                            model, ids, item=item, sampling=samplings[k], prefill_chunk_tokens=CHUNK
                        )
                    )
            prefills = [s for s in seqs if s.prefilling]
            decodes = [s for s in seqs if s.decoding]
            steps.append(([(s, s.next_chunk_tokens()) for s in prefills], decodes))
            for s, out in zip(prefills + decodes, step(model, prefills, decodes), strict=True):
                assert out is None or isinstance(out, int | SequenceError)
                if isinstance(out, SequenceError):
                    errors.append((s, str(out)))
    finally:
        record.remove()
    return seqs, steps, shapes, errors


def test_packed_steps_give_each_sequence_its_tokens_alone(tiny_handle, tokenizer):
    model = tiny_handle.model
    requests = prompts_and_blocks(tiny_handle, tokenizer)
    requests.append((requests[3][0], None))  # a fifth: seeded sampling, runs alone
    assert len(requests[1][0]) > 3 * CHUNK  # prefills in several chunks while the others decode
    samplings = [Sampling(max_new_tokens=n) for n in (5, 12, 9, 3)]
    samplings.append(Sampling(max_new_tokens=6, temperature=0.9, top_p=0.9, seed=5))
    alone = [
        list(generate(model, ids, item=item, sampling=sp))
        for (ids, item), sp in zip(requests, samplings, strict=True)
    ]
    items = [item for _, item in requests if item is not None]
    before = [item.kv.clone() for item in items]
    seqs, steps, shapes, errors = run_packed(model, requests, samplings, arrive_at=[0, 1, 1, 2, 2])
    assert errors == [] and [s.stats.token_ids for s in seqs] == alone
    assert [s.finish_reason for s in seqs] == ["length"] * 5
    assert all(torch.equal(item.kv, kv) for item, kv in zip(items, before, strict=True))
    # every step's chunks and decode rows but the seeded one's: one forward [1, chunk tokens + decode rows]
    packed = []
    for chunks, decodes in steps:
        parts = [n for s, n in chunks if s is not seqs[4]] + [1 for s in decodes if s is not seqs[4]]
        if chunks and len(parts) > 1:
            packed.append((1, sum(parts)))
    assert len(packed) >= 4 and all(shape in shapes for shape in packed)
    mixed = [n for chunks, decodes in steps for s, n in chunks if decodes and s is seqs[1]]
    assert len(mixed) >= 3 and mixed[0] == CHUNK  # the long one's chunks go in while others decode


def test_a_failing_packed_forward_restores_every_cache_and_errors_stay_with_their_sequence(
    tiny_handle, tokenizer
):
    model = tiny_handle.model
    requests = prompts_and_blocks(tiny_handle, tokenizer)
    samplings = [Sampling(max_new_tokens=n) for n in (6, 4, 7, 5)]
    alone = [
        list(generate(model, ids, item=item, sampling=sp))
        for (ids, item), sp in zip(requests, samplings, strict=True)
    ]
    broken = CacheSequence(model, requests[2][0], item=requests[2][1], prefill_chunk_tokens=CHUNK)._prefill
    assert len(broken) < CHUNK
    state = {"failed": 0}

    def fail_midway(_m, _a):  # the first two packed forwards fail at the last layer, the others' K/V appended
        if model.config._attn_implementation == PACKED and state["failed"] < 2:
            state["failed"] += 1
            raise RuntimeError("packed forward failed")

    def fail(_m, _a, kw):  # any forward holding its chunk: the packed one, then the chunk alone
        ids = kw["input_ids"][0].tolist()
        if any(ids[i : i + len(broken)] == broken for i in range(len(ids) - len(broken) + 1)):
            raise RuntimeError("this sequence's prefill failed")

    layer = model.model.layers[-1].register_forward_pre_hook(fail_midway)
    hook = model.register_forward_pre_hook(fail, with_kwargs=True)
    try:
        seqs, steps, _, errors = run_packed(model, requests, samplings, arrive_at=[0, 0, 1, 1])
    finally:
        hook.remove()
        layer.remove()
    assert state["failed"] == 2
    assert errors == [(seqs[2], "RuntimeError: this sequence's prefill failed")]
    assert [s.finish_reason for s in seqs] == ["length", "length", "error", "length"]
    assert [s.stats.token_ids for i, s in enumerate(seqs) if i != 2] == [alone[0], alone[1], alone[3]]
    assert seqs[2].stats.token_ids == []


@pytest.mark.slow
def test_real_model_packed_steps_give_each_sequence_its_tokens_alone(default_handle, tokenizer):
    model = default_handle.model
    requests = prompts_and_blocks(default_handle, tokenizer)
    samplings = [Sampling(max_new_tokens=n) for n in (6, 16, 10, 4)]
    alone = [
        list(generate(model, ids, item=item, sampling=sp))
        for (ids, item), sp in zip(requests, samplings, strict=True)
    ]
    seqs, steps, _, errors = run_packed(model, requests, samplings, arrive_at=[0, 1, 1, 3])
    assert errors == [] and [s.stats.token_ids for s in seqs] == alone
    assert sum(1 for chunks, decodes in steps if chunks and decodes) >= 3

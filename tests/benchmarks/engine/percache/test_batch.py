"""Batched decode (benchmarks/engine/percache/batch.py): sequences with different prompts, blocks (two items, or none), chunked
prefills, arrivals and ends decode together with the tokens each gets alone; seeded sampling stays the
request's own; a failing step stays with its sequence; every forward runs under inference mode."""

from __future__ import annotations

import pytest
import torch

from benchmarks.engine.percache.batch import CacheSequence, SequenceError, decode_step
from kvmem.kv import Sampling, generate
from tests.conftest import ForwardLog, prompts_and_blocks


def run_alone(model, ids, item, sampling, chunk=None) -> list[int]:
    seq = CacheSequence(model, ids, item=item, sampling=sampling, prefill_chunk_tokens=chunk)
    while seq.prefilling:
        seq.prefill_step()
    while seq.decoding:
        assert isinstance(decode_step(model, [seq])[0], int)
    return seq.stats.token_ids


def run_staggered(model, requests, samplings, chunk, arrive_at) -> tuple[list[CacheSequence], list[int]]:
    """CacheSequence k joins at step arrive_at[k]; each step: one prefill chunk per prefilling sequence, then one
    decode step of all decoding ones. Returns the sequences and the batch size of every decode forward."""
    seqs: list[CacheSequence] = []
    sizes: list[int] = []
    step = 0
    while len(seqs) < len(requests) or any(not s.finished for s in seqs):
        for k, (ids, item) in enumerate(requests):
            if arrive_at[k] == step:
                seqs.append(
                    CacheSequence(model, ids, item=item, sampling=samplings[k], prefill_chunk_tokens=chunk)
                )
        for s in seqs:
            if s.prefilling:
                s.prefill_step()
        decoding = [s for s in seqs if s.decoding]
        if decoding:
            sizes.append(len(decoding))
            assert all(isinstance(t, int) for t in decode_step(model, decoding))
        step += 1
    return seqs, sizes


def test_staggered_batch_gives_each_sequence_its_tokens_alone(tiny_handle, tokenizer):
    model = tiny_handle.model
    requests = prompts_and_blocks(tiny_handle, tokenizer)
    assert len({len(ids) for ids, _ in requests}) == 4 and len(requests[1][0]) > 3 * 32  # chunked
    samplings = [Sampling(max_new_tokens=n) for n in (5, 12, 9, 3)]
    alone = [
        run_alone(model, ids, item, sp, chunk=32) for (ids, item), sp in zip(requests, samplings, strict=True)
    ]
    assert alone[0] == list(generate(model, requests[0][0], item=requests[0][1], sampling=samplings[0]))
    log = ForwardLog(model)
    try:
        seqs, sizes = run_staggered(model, requests, samplings, chunk=32, arrive_at=[0, 1, 1, 2])
    finally:
        log.remove()
    assert [s.stats.token_ids for s in seqs] == alone
    assert [s.finish_reason for s in seqs] == ["length"] * 4
    assert [s.stats.reused_tokens for s in seqs] == [
        requests[0][1].num_tokens,
        0,
        requests[2][1].num_tokens,
        0,
    ]
    # prefills of 12, 196 (7 chunks of 32), 25 and 54 (2) tokens past the blocks (layout 3's prompts); the decode batch as they come
    # and go: 0 alone, 0+2 (1 is still prefilling), 0+2+3, 2+3, 2 alone, then 1+2 and 1 alone
    assert sizes == [1, 2, 2, 3, 2, 1, 1, 2, 2] + [1] * 9 and sum(sizes) == sum(len(a) - 1 for a in alone)
    rest = [len(ids) - (item.num_tokens if item else 0) for ids, item in requests]
    chunks = [c for n in rest for c in [32] * (n // 32) + [n % 32] if c]
    assert rest == [12, 196, 25, 54] and len(log.calls) == len(chunks) + len(sizes)
    assert sorted(n for n, *_ in log.calls if n > 1) == sorted(c for c in chunks if c > 1)
    assert all(tuple(state) == (True, False, False) for _, *state in log.calls)
    assert torch.is_inference_mode_enabled() is False


def test_chunked_prefill_runs_the_same_tokens_as_one_forward(tiny_handle, tokenizer):
    model = tiny_handle.model
    ids, _ = prompts_and_blocks(tiny_handle, tokenizer)[1]
    whole = list(generate(model, ids, sampling=Sampling(max_new_tokens=10)))
    log = ForwardLog(model)
    try:
        chunked = run_alone(model, ids, None, Sampling(max_new_tokens=10), chunk=32)
    finally:
        log.remove()
    assert chunked == whole
    n = len(ids)
    assert [c for c, *_ in log.calls] == [32] * (n // 32) + ([n % 32] if n % 32 else []) + [1] * 9


def test_seeded_sampling_in_a_batch_is_the_requests_own(tiny_handle, tokenizer):
    model = tiny_handle.model
    requests = prompts_and_blocks(tiny_handle, tokenizer)
    samplings = [Sampling(max_new_tokens=8, temperature=0.9, top_p=0.9, seed=7 + k) for k in range(4)]
    samplings[2] = Sampling(max_new_tokens=8)  # greedy, batched with the unseeded one
    samplings[3] = Sampling(max_new_tokens=8, temperature=0.9, top_p=0.9)  # unseeded: batched
    alone = [
        run_alone(model, ids, item, sp) for (ids, item), sp in zip(requests[:3], samplings, strict=False)
    ]
    rows: list[int] = []
    hook = model.register_forward_pre_hook(
        lambda _m, _a, kw: rows.append(kw["input_ids"].shape[0]), with_kwargs=True
    )
    try:
        seqs, sizes = run_staggered(model, requests, samplings, chunk=None, arrive_at=[0, 0, 2, 2])
    finally:
        hook.remove()
    assert [s.stats.token_ids for s in seqs[:3]] == alone and len(seqs[3].stats.token_ids) == 8
    # the two seeded ones decode alone (batch 1), the greedy and the unseeded one together from step 2 on
    assert max(rows) == 2 and rows.count(2) == 7
    assert alone[0] != run_alone(model, *requests[0], Sampling(max_new_tokens=8, temperature=0.9, seed=99))


def test_a_failing_batched_forward_is_retried_alone_and_an_error_stays_with_its_sequence(
    tiny_handle, tokenizer
):
    model = tiny_handle.model
    requests = prompts_and_blocks(tiny_handle, tokenizer)[:3]
    sp = Sampling(max_new_tokens=6)
    alone = [run_alone(model, ids, item, sp) for ids, item in requests]
    seqs = [CacheSequence(model, ids, item=item, sampling=sp) for ids, item in requests]
    for s in seqs:
        s.prefill_step()
    broken = seqs[1]

    def fail(_m, _a, kw):
        batched = kw["input_ids"].shape[0] > 1
        if batched and len(seqs[0].stats.token_ids) == 3:
            raise RuntimeError("batched forward failed")  # once: each then runs alone, and all succeed
        if (batched or kw["past_key_values"] is broken.cache) and len(broken.stats.token_ids) == 4:
            raise RuntimeError("this sequence's forward failed")  # batched, then alone for `broken` only

    hook = model.register_forward_pre_hook(fail, with_kwargs=True)
    errors = []
    try:
        while any(s.decoding for s in seqs):
            decoding = [s for s in seqs if s.decoding]
            for s, out in zip(decoding, decode_step(model, decoding), strict=True):
                if isinstance(out, SequenceError):
                    errors.append((s, str(out)))
    finally:
        hook.remove()
    assert errors == [(broken, "RuntimeError: this sequence's forward failed")]
    assert [s.finish_reason for s in seqs] == ["length", "error", "length"]
    assert [s.stats.token_ids for s in seqs] == [alone[0], alone[1][:4], alone[2]]


def test_cancel_is_taken_at_a_step_boundary(tiny_handle, tokenizer):
    ids, item = prompts_and_blocks(tiny_handle, tokenizer)[1]
    stop = []
    seq = CacheSequence(
        tiny_handle.model,
        ids,
        sampling=Sampling(max_new_tokens=50),
        should_stop=lambda: bool(stop),
        prefill_chunk_tokens=32,
    )
    seq.prefill_step()
    assert not seq.check_cancel() and seq.prefilling
    stop.append(1)
    assert seq.check_cancel() and seq.finish_reason == "cancelled" and not seq.prefilling
    with pytest.raises(ValueError, match="empty prompt"):
        CacheSequence(tiny_handle.model, [])
    with pytest.raises(ValueError, match="prefill_chunk_tokens must be >= 1"):
        CacheSequence(tiny_handle.model, ids, prefill_chunk_tokens=0)


@pytest.mark.slow
def test_real_model_batch_gives_each_sequence_its_tokens_alone(default_handle, tokenizer):
    model = default_handle.model
    requests = prompts_and_blocks(default_handle, tokenizer)
    samplings = [Sampling(max_new_tokens=n) for n in (6, 16, 10, 4)]
    alone = [
        run_alone(model, ids, item, sp, chunk=64) for (ids, item), sp in zip(requests, samplings, strict=True)
    ]
    whole = list(generate(model, requests[1][0], sampling=samplings[1]))  # the chunked one, in one forward
    seqs, sizes = run_staggered(model, requests, samplings, chunk=64, arrive_at=[0, 1, 1, 3])
    assert [s.stats.token_ids for s in seqs] == alone
    assert alone[1] == whole
    assert max(sizes) == 4

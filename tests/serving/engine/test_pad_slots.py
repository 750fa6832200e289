"""What an eager step's padding reads (serving/engine/plan.py): rows of different lengths are gathered into one
tensor, each padded to the longest; the pad entries read the pool's scratch slot (one slot past the last page,
in no page, zeroed at start), never slot 0, which is the first page's: another request's K/V or memory no one
wrote. A pad is masked out, but a NaN under the mask still poisons the row (NaN x 0 is NaN), so the real rows'
logits must not depend on what slot 0 holds."""

from __future__ import annotations

import pytest
import torch

from kvmem.kv import Sampling
from serving.engine import plan, runner
from tests.conftest import prompts_and_blocks
from tests.serving.engine.test_engine import admitted, make_pool

CHUNK = 32


@pytest.fixture(params=["every prefix grouped", "production threshold"])
def grouping(request, monkeypatch):
    """Rows read shared pages once per group (the grouped gathers' padding), or with their rest."""
    if request.param == "every prefix grouped":
        monkeypatch.setattr(plan, "GROUP_MIN_READS", 0)
    return request.param


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def step_logits(model, pool, prefills, decodes) -> torch.Tensor:
    """The logits of the step runner.step would run now (its rows and chunks), leaving every table and position
    as it was."""
    seqs = prefills + decodes
    chunks = [s._prefill[: s.next_chunk_tokens()] for s in prefills] + [[s.last_token] for s in decodes]
    saved = [(s.table.length, s.position) for s in seqs]
    try:
        with torch.inference_mode():
            return runner.forward(model, pool, seqs, chunks)
    finally:
        for s, (length, position) in zip(seqs, saved, strict=True):
            s.table.length, s.position = length, position


def test_padded_rows_read_the_scratch_slot_not_slot_0(tiny_handle, tokenizer, grouping):
    """Four requests of different lengths (two over blocks of different lengths, so that rows share pages and,
    with every prefix grouped, are read by prefix group) arriving over several steps: steps that mix prefill
    chunks (wide rows, padded to the longest context) and decode rows (narrow, padded to the longest rest).
    Slot 0 belongs to no request; NaN in it leaves every step's logits bit for bit as they are with zeros
    there (before the fix, pads read slot 0 and the padded rows' logits were NaN)."""
    model = tiny_handle.model
    pool = make_pool(model)
    assert pool.alloc(1) == [0]  # slot 0's page: no request's (as another request's pages would be)
    requests = prompts_and_blocks(tiny_handle, tokenizer)
    arrive = [0, 0, 2, 5]
    seqs, steps, compared = [], 0, 0
    while len(seqs) < len(requests) or any(not s.finished for s in seqs):
        for k, (ids, item) in enumerate(requests):
            if arrive[k] == steps:
                seqs.append(
                    admitted(
                        pool,
                        model,
                        ids,
                        item,
                        sampling=Sampling(max_new_tokens=6),
                        prefill_chunk_tokens=CHUNK,
                    )
                )
        prefills = [s for s in seqs if s.prefilling]
        decodes = [s for s in seqs if s.decoding]
        if len(prefills) + len(decodes) > 1:  # rows of different lengths: some are padded
            pool.k[:, 0], pool.v[:, 0] = 0.0, 0.0
            clean = step_logits(model, pool, prefills, decodes)
            pool.k[:, 0], pool.v[:, 0] = float("nan"), float("nan")
            poisoned = step_logits(model, pool, prefills, decodes)
            assert bool(clean.isfinite().all())
            assert same_bits(poisoned, clean), f"step {steps}: a padded row read slot 0"
            compared += 1
        runner.step(model, pool, prefills, decodes)
        steps += 1
    assert compared >= 8
    assert all(s.finish_reason == "length" and len(s.stats.token_ids) == 6 for s in seqs)
    for s in seqs:
        s.release()
    pool.release([0])
    assert pool.used_pages == pool.shared.page_count()

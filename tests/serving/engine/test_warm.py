"""The eager step's warm-up at load (serving/engine/warm.py): the forms it runs, in order, on scratch pages that go
back; what serves after it is what serves without it; a failure inside it is logged and costs nothing else."""

from __future__ import annotations

import logging

import pytest
import torch

from kvmem.kv import Sampling
from serving.engine import runner, warm
from tests.conftest import prompts_and_blocks
from tests.serving.engine.test_engine import layers, make_pool, run_engine  # noqa: F401 - `layers` is a fixture


@pytest.mark.usefixtures("layers")
def test_warm_runs_the_masked_the_causal_and_the_narrow_forms_then_gives_the_pages_back(
    tiny_handle, monkeypatch
):
    model = tiny_handle.model
    pool = make_pool(model)
    free = pool.free_pages
    forms = []

    def recorded(model, pool, seqs, chunks):
        forms.append(([s.position for s in seqs], [len(c) for c in chunks], pool.free_pages))
        logits = runner.forward(model, pool, seqs, chunks)
        assert logits.shape[0] == len(chunks) and bool(torch.isfinite(logits).all())
        return logits

    monkeypatch.setattr(warm, "forward", recorded)
    seconds = warm.warm_eager(model, pool)
    # two chunks at once (wide rows, one padded: the masked form), one chunk beside a decode row, a decode step;
    # positions advance as a sequence's would; the scratch tables hold 3 + 2 pages of 16 tokens
    assert forms == [
        ([0, 0], [40, 24], free - 5),
        ([40, 24], [2, 1], free - 5),
        ([42, 25], [1, 1], free - 5),
    ]
    assert pool.free_pages == free and seconds > 0


@pytest.mark.usefixtures("layers")
def test_what_serves_after_the_warm_is_what_serves_without_it(tiny_handle, tokenizer):
    """Four requests of different lengths, two over blocks, arriving over several steps: the same tokens on a
    pool the warm-up ran on (its pages written, then freed, then given to the requests) as on a fresh one."""
    model = tiny_handle.model
    requests = prompts_and_blocks(tiny_handle, tokenizer)
    samplings = [Sampling(max_new_tokens=n) for n in (9, 4, 12, 6)]
    fresh, errors = run_engine(model, make_pool(model), requests, samplings, [0, 0, 2, 5])
    assert not errors
    warmed_pool = make_pool(model)
    warm.warm_eager(model, warmed_pool)
    warmed, errors = run_engine(model, warmed_pool, requests, samplings, [0, 0, 2, 5])
    assert not errors
    assert [s.stats.token_ids for s in warmed] == [s.stats.token_ids for s in fresh]
    assert all(len(s.stats.token_ids) == n.max_new_tokens for s, n in zip(fresh, samplings, strict=True))


def test_a_failing_warm_is_logged_and_gives_the_pages_back(tiny_handle, monkeypatch, caplog):
    pool = make_pool(tiny_handle.model)
    free = pool.free_pages

    def broken(*args):
        raise RuntimeError("no kernel")

    monkeypatch.setattr(warm, "forward", broken)
    with caplog.at_level(logging.WARNING, logger="serving.engine.warm"):
        assert warm.warm_eager(tiny_handle.model, pool) >= 0
    assert pool.free_pages == free
    assert [r.getMessage() for r in caplog.records] == [
        "warming the eager step failed; the first such step sets its kernels up"
    ]


def test_a_pool_too_small_for_the_second_table_gives_the_first_back(tiny_handle, caplog):
    pool = make_pool(tiny_handle.model, mb=0.25 * 4 / 32)  # 4 pages: room for the first scratch table (3)
    free = pool.free_pages
    assert pool.pages_for(43) <= free < pool.pages_for(43) + pool.pages_for(27)
    with caplog.at_level(logging.WARNING, logger="serving.engine.warm"):
        warm.warm_eager(tiny_handle.model, pool)
    assert pool.free_pages == free and len(caplog.records) == 1

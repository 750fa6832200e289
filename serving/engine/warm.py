"""The eager step's forms run once at load, on scratch pages, so that the first requests do not pay for what a
device sets up on a kernel's first call.

The graphs (graphs.py, prefill_graphs.py) run their steps once when they are captured; a step they do not take
(several prefill chunks, or chunks beside decode rows) runs eagerly, and its attention takes other forms
(attention.wide): two chunks or more are one `scaled_dot_product_attention` with an additive mask, which on a
recent NVIDIA card is cuDNN's kernel, whose plan is built on its first call; one chunk is the causal form. Before
2322adf the lone-chunk captures ran the masked form too, so it was set up at load; since then the first burst of
a many-users run waited for it in its first step (benchmarks/results/gpu/h200/README.md: every request's time to
first token ~3 s later, the steps after it as fast as before; the cause is this reading of the figures, to be
confirmed on a card with `eager_warm_s` in benchmarks/gpu/many_users_gpu.py's JSON).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from serving.engine.pages import PagePool
from serving.engine.runner import forward
from serving.engine.table import PageTable

log = logging.getLogger(__name__)

CHUNKS = (40, 24)  # two prefill chunks of different lengths (a padded, masked row among them)


@dataclass
class _Scratch:
    """What a step reads of a sequence (runner.forward, plan.StepPlan): its table, its position, no adapter."""

    table: PageTable
    position: int = 0
    adapter: str | None = None


def warm_eager(model: torch.nn.Module, pool: PagePool, chunks: tuple[int, ...] = CHUNKS) -> float:
    """Three eager forwards on scratch tables: every chunk of `chunks` at once (the masked form), then one chunk
    beside a decode row (the causal form and the narrow rows), then a decode step of every row; the pages go
    back to the pool. Returns the seconds it took (on a GPU, what the first burst would have waited). A failure
    is logged, not raised: serving goes on, and its first such step sets the kernels up instead."""
    token = int(getattr(model.config.get_text_config(), "bos_token_id", None) or 0)
    began = time.perf_counter()
    tables: list[PageTable] = []
    try:
        with torch.inference_mode():
            for n in chunks:  # one by one: a table admitted before a failure still goes back
                tables.append(PageTable.admit(pool, n + 3))
            seqs = [_Scratch(t) for t in tables]
            steps = (
                [[token] * n for n in chunks],
                [[token] * 2] + [[token]] * (len(seqs) - 1),
                [[token]] * len(seqs),
            )
            for step in steps:
                forward(model, pool, seqs, step)
                for s, c in zip(seqs, step, strict=True):
                    s.position += len(c)
            if pool.k.device.type == "cuda":
                torch.cuda.synchronize(pool.k.device)
    except Exception:  # noqa: BLE001 - a warm-up: its failure costs the first step's time, nothing else
        log.warning("warming the eager step failed; the first such step sets its kernels up", exc_info=True)
    finally:
        for t in tables:
            t.close()
    return time.perf_counter() - began

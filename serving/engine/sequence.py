"""A request's sequence whose K/V live in the page pool (pages.py) instead of a cache of its own.

It is a `percache.batch.Sequence` (the same lifecycle, sampling, chunking and stats) whose `table` holds its
positions: an injected block's pages by reference, or the pages a live session's last turn left (by
reference too: `admit(source=...)`), its own tokens in its own pages; when its turn ends its table can stay
with the session (`keep_table`). It runs only through the engine's step (runner.py), alone or with others, one path.
Admission reserves pages for the prompt and the longest reply; `admit` waits for them (the caller yields
between tries) and raises PoolFull (429) after `wait_s`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from kvmem.kv.inject import usable_prefix_tokens
from serving.engine.pages import PagePool, PoolFull
from serving.engine.percache.batch import Sequence
from serving.engine.table import PageTable


class PagedSequence(Sequence):
    def __init__(
        self,
        model: torch.nn.Module,
        prompt_ids,
        *,
        table: PageTable,
        reused: int,
        adapter: str | None = None,
        idle_chunk_tokens: int | None = None,
        busy_attention_budget: int | None = None,
        **kwargs,
    ) -> None:
        super().__init__(model, prompt_ids, **kwargs)
        # a background prefill (a block build): its chunk is `prefill_chunk_tokens` while other sequences
        # decode, so their steps stay short, and `idle_chunk_tokens` while nothing else runs (see `pace`)
        self._chunks = None if idle_chunk_tokens is None else (self.chunk, idle_chunk_tokens)
        self._budget = busy_attention_budget
        self.adapter = adapter  # the peft adapter its tokens run under (lora.py), None: the base model
        self.cache = None  # the pool holds its K/V
        self.table = table
        self.stats.reused_tokens, self.stats.prefilled_tokens = reused, len(prompt_ids) - reused
        self.position = reused
        self._prefill = list(prompt_ids[reused:])

    @property
    def batchable(self) -> bool:  # every paged sequence runs in the step, seeded ones too (sampler.py)
        return True

    def pace(self, busy: bool) -> None:
        """Before a step: a background prefill takes small chunks when other sequences decode (`busy`), and
        with `busy_attention_budget` at most that many (chunk tokens x tokens of context): a chunk's
        attention grows with the context it reads, so late in a long build its chunks shrink."""
        if self._chunks is not None:
            self.chunk = self._chunks[0] if busy else self._chunks[1]
            if busy and self._budget is not None:
                self.chunk = max(1, min(self.chunk, self._budget // max(self.position, 1)))

    def release(self) -> None:
        """Give back its pages (idempotent)."""
        self.table.close()

    def keep_table(self) -> PageTable:
        """Its table, trimmed to the positions written, for a live session to keep (kvmem/kv/session.py); the
        sequence no longer holds it."""
        table, self.table = self.table, PageTable(self.table.pool)
        self.table.close()
        return table.keep(table.length)


def admit(
    pool: PagePool,
    model: torch.nn.Module,
    prompt_ids,
    *,
    item=None,
    source: tuple[PageTable, int] | None = None,
    max_new_tokens: int,
    wait_s: float = 10.0,
    **kwargs,
) -> Iterator[PagedSequence | None]:
    """Yields None while the pool has no room (the caller gives the model loop a turn), then the sequence.
    An injected block shares its pages, and so does `source` (a live session's table, and the tokens of it
    the prompt reuses)."""
    total = len(prompt_ids) + max_new_tokens
    reuse = 0
    if source is not None:
        reuse = source[1]
    elif item is not None:
        reuse = max(usable_prefix_tokens(item, prompt_ids), 0)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            table = PageTable.admit(
                pool, total, item=item, reuse=reuse, source=None if source is None else source[0]
            )
            break
        except PoolFull:
            if time.monotonic() >= deadline:
                raise
            yield None
    try:
        seq = PagedSequence(model, prompt_ids, table=table, reused=reuse, **kwargs)
    except BaseException:
        table.close()
        raise
    yield seq

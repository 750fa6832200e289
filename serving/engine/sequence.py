"""A request's sequence: its generation state, its K/V in the page pool (pages.py), and its admission.

An `EngineSequence` holds a request's lifecycle (prefilling -> decoding -> finished), sampling (with its own seeded
generator), chunked prefill and stats; its `table` holds its positions: an injected block's pages by
reference, or the pages a live session's last turn left (by reference too: `admit(source=...)`), its own
tokens in its own pages; when its turn ends its table can stay with the session (`keep_table`). It runs only
through the engine's step (runner.py), alone or with others: the server's one decode path. Admission reserves
pages for the prompt and the longest reply; `admit` waits for them (the caller yields between tries) and
raises PoolFull (429) after `wait_s`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq

import torch

from kvmem.kv.inject import usable_prefix_tokens
from kvmem.kv.sampling import GenerationStats, Sampling
from serving.engine.pages import PagePool, PoolFull
from serving.engine.table import PageTable


class EngineSequence:
    """One request's tokens, produced by the engine's steps (runner.step).

    `finish_reason` (also in `stats`) is "stop" after a stop token, "length" after `max_new_tokens`,
    "cancelled" once `should_stop()` is true at a step boundary, "error" when its step failed. Its prompt is
    prefilled in chunks of `prefill_chunk_tokens` (all at once if None); a background prefill (a block build)
    paces its chunks (`pace`).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        prompt_ids: Seq[int],
        *,
        table: PageTable,
        reused: int,
        adapter: str | None = None,
        sampling: Sampling | None = None,
        stop_token_ids: frozenset[int] = frozenset(),
        should_stop: Callable[[], bool] | None = None,
        stats: GenerationStats | None = None,
        prefill_chunk_tokens: int | None = None,
        idle_chunk_tokens: int | None = None,
        busy_attention_budget: int | None = None,
    ) -> None:
        if prefill_chunk_tokens is not None and prefill_chunk_tokens < 1:
            raise ValueError(f"prefill_chunk_tokens must be >= 1 or None, got {prefill_chunk_tokens}")
        if not prompt_ids:
            raise ValueError("cannot generate from an empty prompt (0 tokens)")
        sampling = sampling if sampling is not None else Sampling()
        self.model, self.sampling, self.stop_token_ids = model, sampling, stop_token_ids
        self.should_stop, self.chunk = should_stop, prefill_chunk_tokens
        self.stats = stats if stats is not None else GenerationStats()
        self.stats.prompt_tokens = len(prompt_ids)
        self.device = next(model.parameters()).device
        self.generator = None
        if sampling.temperature > 0 and sampling.seed is not None:
            self.generator = torch.Generator(device=self.device).manual_seed(sampling.seed)
        self.started = time.perf_counter()
        # a background prefill (a block build): its chunk is `prefill_chunk_tokens` while other sequences
        # decode, so their steps stay short, and `idle_chunk_tokens` while nothing else runs (see `pace`)
        self._chunks = None if idle_chunk_tokens is None else (self.chunk, idle_chunk_tokens)
        self._budget = busy_attention_budget
        self.adapter = adapter  # the peft adapter its tokens run under (lora.py), None: the base model
        self.table = table
        self.stats.reused_tokens, self.stats.prefilled_tokens = reused, len(prompt_ids) - reused
        self.position = reused  # positions its table holds
        self._prefill = list(prompt_ids[reused:])  # prompt tokens not yet in the pool
        self.last_token: int | None = None
        self.finish_reason: str | None = None

    @property
    def prefilling(self) -> bool:
        return self.finish_reason is None and bool(self._prefill)

    @property
    def decoding(self) -> bool:
        return self.finish_reason is None and not self._prefill

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def next_chunk_tokens(self) -> int:
        """How many prompt tokens its next prefill chunk runs."""
        return len(self._prefill) if self.chunk is None else min(self.chunk, len(self._prefill))

    def check_cancel(self) -> bool:
        """At a step boundary: end the sequence ("cancelled") if its caller asked to stop."""
        if self.finish_reason is None and self.should_stop is not None and self.should_stop():
            self._finish("cancelled")
        return self.finished

    def _accept(self, token: int) -> None:
        if not self.stats.token_ids:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.stats.ttft_s = time.perf_counter() - self.started
        self.stats.token_ids.append(token)
        self.last_token = token
        if token in self.stop_token_ids:
            self._finish("stop")
        elif len(self.stats.token_ids) >= self.sampling.max_new_tokens:
            self._finish("length")

    def _finish(self, reason: str) -> None:
        self.finish_reason = self.stats.finish_reason = reason

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
        """Its table, trimmed to the positions written, for a live session to keep (serving/engine/sessions.py); the
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
) -> Iterator[EngineSequence | None]:
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
        seq = EngineSequence(model, prompt_ids, table=table, reused=reuse, **kwargs)
    except BaseException:
        table.close()
        raise
    yield seq


class SequenceError(RuntimeError):
    """A step failed for this sequence alone (the others in its step are unaffected)."""

    def __init__(self, seq: EngineSequence, cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.seq, self.cause = seq, cause

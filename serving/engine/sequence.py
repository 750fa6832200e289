"""A request's sequence: its generation state, its K/V in the page pool (pages.py), and its admission.

An `EngineSequence` holds a request's lifecycle (prefilling -> decoding -> finished), sampling (with its own seeded
generator), chunked prefill and stats; its `table` holds its positions: an injected block's pages by
reference, or the pages a live session's last turn left (by reference too: `admit(source=...)`), its own
tokens in its own pages; when its turn ends its table can stay with the session (`keep_table`). It runs only
through the engine's step (runner.py), alone or with others: the server's one decode path. A sequence the
batcher preempts (its pages are needed by an older one) gives its own pages back and, once admitted again,
prefills its prompt and the tokens it generated so far again (recompute), then samples its next token from
their last position, as its decode step would have: its stream goes on where it was.

Admission (`admit`) takes pages for the prompt only; a request whose prompt and longest reply could never fit
in the whole pool is refused at once (PoolTooSmall, 400). One that does not fit now waits: it yields an
`AdmissionWait`, on which the model loop parks it until the pool's room may have changed, its caller
cancelled or its deadline passed (no spin, no eviction on every try), and raises PoolFull (429) after
`wait_s`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq

import torch

from kvmem.kv.inject import usable_prefix_tokens
from kvmem.kv.sampling import GenerationStats, Sampling
from serving.engine.errors import PoolTooSmall
from serving.engine.pages import PagePool, PoolFull
from serving.engine.prefix_cache import PrefixKey, page_hashes
from serving.engine.table import PageTable


class EngineSequence:
    """One request's tokens, produced by the engine's steps (runner.step).

    `finish_reason` (also in `stats`) is "stop" after a stop token, "length" after `max_new_tokens` (or after
    a stop token that ends a JSON reply closed early to fit them: grammar.py), "cancelled" once `should_stop()`
    is true at a step boundary, "error" when its step failed. Its prompt is prefilled in chunks of
    `prefill_chunk_tokens` (all at once if None); a background prefill (a block build) paces its chunks
    (`pace`).
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
        grammar=None,
        background: bool = False,
    ) -> None:
        if prefill_chunk_tokens is not None and prefill_chunk_tokens < 1:
            raise ValueError(f"prefill_chunk_tokens must be >= 1 or None, got {prefill_chunk_tokens}")
        if not prompt_ids:
            raise ValueError("cannot generate from an empty prompt (0 tokens)")
        sampling = sampling if sampling is not None else Sampling()
        self.model, self.sampling, self.stop_token_ids = model, sampling, stop_token_ids
        self.should_stop, self.chunk = should_stop, prefill_chunk_tokens
        self.grammar = grammar  # a grammar.Matcher: its tokens masked to a response format (sampler.py)
        self.background = background  # low priority (memory formation): batcher.py's budget
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
        self.prompt_ids = list(prompt_ids)
        self._prefill = list(prompt_ids[reused:])  # prompt tokens not yet in the pool
        self.preempted = False  # its own pages went back; it waits to be admitted again (batcher.py)
        # how long it may wait to be admitted again while nothing else runs (batcher.py), its admission's wait
        self.wait_s = DEFAULT_WAIT_S
        self.num_preemptions = 0
        self.last_token: int | None = None
        self.finish_reason: str | None = None
        self.prefix: PrefixKey | None = None  # whose K/V its pages are, for the prefix cache (`cache_prefix`)

    @property
    def prefilling(self) -> bool:
        return self.finish_reason is None and bool(self._prefill) and not self.preempted

    @property
    def decoding(self) -> bool:
        return self.finish_reason is None and not self._prefill and not self.preempted

    def step_tokens(self) -> int:
        """Positions its next step writes: its next chunk's, or one (a decode step)."""
        return self.next_chunk_tokens() if self._prefill else 1

    def preempt(self) -> None:
        """Give back its own pages (table.preempt) and prefill again, once readmitted, every token after the
        ones it reuses: the rest of its prompt and all it generated (the last of which its next decode step
        would have fed)."""
        self.table.preempt()
        self.position = self.table.length
        self._prefill = (self.prompt_ids + self.stats.token_ids)[self.position :]
        self.preempted = True
        self.num_preemptions += 1

    def readmit(self) -> bool:
        """Pages again for everything it prefills again, in one run when the pool has one; False when the pool
        does not have them (it stays preempted)."""
        if not self.table.readmit(self.position + len(self._prefill)):
            return False
        self.preempted = False
        return True

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
        if token in self.stop_token_ids:  # a response format closed to fit the budget was cut: "length"
            self._finish("length" if self.grammar is not None and self.grammar.closed_early else "stop")
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

    def cache_prefix(self) -> int:
        """When its request is done with it (not failed): its full pages go into the pool's prefix cache
        (prefix_cache.py) for a next request of its user that starts with the same tokens; every position its
        table holds was written by a step that completed. Returns the pages that went in."""
        if self.prefix is None or self.finish_reason == "error" or self.preempted:
            return 0
        fed = (self.prompt_ids + self.stats.token_ids)[: self.table.length]
        return self.table.cache_prefix(self.prefix, fed)

    def keep_table(self) -> PageTable:
        """Its table, trimmed to the positions written, for a live session to keep (serving/engine/sessions.py); the
        sequence no longer holds it."""
        table, self.table = self.table, PageTable(self.table.pool)
        self.table.close()
        return table.keep(table.length)


class AdmissionWait:
    """What a request waiting for pages yields: the model loop (model_loop.py) steps it again once `ready`,
    i.e. the pool's room may have changed (`pool.generation` moved on: pages freed, an item's last reader
    gone, a preempted sequence admitted again), its caller asked to stop, or its deadline passed; meanwhile
    it costs nothing. `ready` takes no lock (the loop calls it under its own)."""

    def __init__(
        self, pool: PagePool, generation: int, deadline: float, should_stop: Callable[[], bool] | None
    ) -> None:
        self.pool, self.generation, self.deadline, self.should_stop = pool, generation, deadline, should_stop

    def ready(self) -> bool:
        return (
            self.pool.generation != self.generation
            or (self.should_stop is not None and self.should_stop())
            or time.monotonic() >= self.deadline
        )


DEFAULT_WAIT_S = 10.0  # a request's wait for pages when none is given (the server's --kv-wait-s default)


def pages_needed(
    pool: PagePool, total_tokens: int, item=None, reuse: int = 0, source=None, prompt_tokens: int = 0
) -> int:
    """Pages a sequence of `total_tokens` positions holds at its longest: its table's, and the rest of the
    item whose first `reuse` positions it reads (with its knowledge parents' pages it does not reference), or
    (`source`, a live session's table it starts from) the pages of the item that table began with that it does not reference (the item stays held while it runs);
    and at its admission, when `reuse` ends mid-page, the session's page it copies from beside its prompt's
    (`prompt_tokens`) own pages (the session's table goes once it is admitted: sessions.py `started`)."""
    need = pool.pages_for(total_tokens)
    if source is not None:
        item_rest = len(
            pool.shared.held_pages(source._shared) - set(source.pages[: reuse // pool.page_tokens])
        )
        at_admission = pool.pages_for(prompt_tokens) + (1 if reuse % pool.page_tokens else 0)
        need = max(need, at_admission) + item_rest
    elif item is not None and reuse:  # the item and its knowledge parents, past the pages the table reads
        need += pool.shared.reader_pages(item) - reuse // pool.page_tokens
    return need


def admit(
    pool: PagePool,
    model: torch.nn.Module,
    prompt_ids,
    *,
    item=None,
    source: tuple[PageTable, int] | None = None,
    prefix: PrefixKey | None = None,
    max_new_tokens: int,
    wait_s: float = DEFAULT_WAIT_S,
    should_stop: Callable[[], bool] | None = None,
    yield_to_chat: bool = False,
    **kwargs,
) -> Iterator[EngineSequence | AdmissionWait]:
    """Yields an AdmissionWait while the pool has no room for the prompt (the caller yields it to the model
    loop), then the sequence; returns without one if `should_stop()` turns true while it waits (a client
    that left). An injected block shares its pages, and so does `source` (a live session's table, and the
    tokens of it the prompt reuses; closed if the request has to wait, which then starts from `item`); without
    a source, `prefix` (whose K/V they are) finds the prompt's
    cached pages (prefix_cache.py), and the sequence's go in when it ends (`cache_prefix`). Raises
    PoolTooSmall at once when the prompt and `max_new_tokens` could never fit in the whole pool, PoolFull
    once it waited `wait_s`. Requests that wait are admitted in the order they came (waiting.py)."""
    total = len(prompt_ids) + max_new_tokens
    reuse = 0
    if source is not None:
        reuse = source[1]
    elif item is not None:
        reuse = max(usable_prefix_tokens(item, prompt_ids), 0)
    need = pages_needed(pool, total, item, reuse, None if source is None else source[0], len(prompt_ids))
    if need > pool.num_pages:
        raise PoolTooSmall(total, need, pool.num_pages, pool.page_tokens)
    deadline = time.monotonic() + wait_s
    hashes = page_hashes(prefix, prompt_ids, pool.page_tokens) if prefix is not None else None
    # a background row's, or a build's (`yield_to_chat`), admission waits behind every chat request's
    background = bool(kwargs.get("background", False)) or yield_to_chat
    ticket = None  # its place among the requests that wait (waiting.py), from its first wait on
    try:
        while True:
            try:
                table = PageTable.admit(
                    pool,
                    len(prompt_ids),
                    item=item,
                    reuse=reuse,
                    source=None if source is None else source[0],
                    hashes=hashes,
                    background=background,
                    ticket=ticket,
                )
                break
            except PoolFull as full:
                if should_stop is not None and should_stop():
                    return
                if time.monotonic() >= deadline:
                    raise
                if source is not None:
                    # a session's turn gives its history's pages back before it waits: held, they could be
                    # the very pages a preempted request (which goes first) needs, and neither could go on.
                    # It prefills its prompt from its block instead (exact either way: sessions.py)
                    source[0].close()
                    source = None
                    reuse = max(usable_prefix_tokens(item, prompt_ids), 0) if item is not None else 0
                    need = pages_needed(pool, total, item, reuse, None, len(prompt_ids))
                    if need > pool.num_pages:
                        raise PoolTooSmall(total, need, pool.num_pages, pool.page_tokens) from None
                if ticket is None:
                    ticket = pool.waiting.join(background, deadline)
                # the generation when it gave up, under the pool's lock: a change after it wakes the wait
                yield AdmissionWait(pool, full.generation, deadline, should_stop)
    finally:
        if ticket is not None:  # admitted, gave up or closed: the next one that waits may go
            pool.waiting.leave(ticket)
    try:
        seq = EngineSequence(
            model, prompt_ids, table=table, reused=table.reused, should_stop=should_stop, **kwargs
        )
        seq.prefix, seq.wait_s = prefix, wait_s
    except BaseException:
        table.close()
        raise
    yield seq


class SequenceError(RuntimeError):
    """A step failed for this sequence alone (the others in its step are unaffected)."""

    def __init__(self, seq: EngineSequence, cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.seq, self.cause = seq, cause

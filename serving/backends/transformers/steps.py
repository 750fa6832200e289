"""A request of the transformers backend in the engine: its generator on the model thread (`_steps`: admit
its sequence, take the batcher's tokens, detokenize, match stops, keep a session's pages) and the async
stream the chat path reads (`stream`: the items across threads, a disconnect or a full pool answered).

A mixin of TransformersBackend (backend.py), which owns the model, the store, the pool and the admission
count; this module owns only what one request does with them. Knows nothing of HTTP or plans.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Generator
from dataclasses import replace

from serving.backends.base import (
    BackendError,
    GenerationRequest,
    GenerationResult,
    InvalidResponseFormat,
    PoolFull,
    PoolTooSmall,
    ResponseFormat,
    StreamItem,
    TokenDelta,
    TokenLogprob,
    TopLogprob,
)
from serving.backends.transformers.adapters import with_adapter
from serving.engine.detok import IncrementalDetokenizer
from serving.engine.handoff import Inbox
from serving.engine.prefix_cache import PrefixKey
from serving.engine.stops import StopMatcher

log = logging.getLogger("serving.backends.transformers.backend")  # one logger for the backend's lines
BACKGROUND_CHUNK_TOKENS = 16  # a background (formation) row's prefill chunk while chat rows decode


class EngineRequests:
    """What one request does in the engine (the backend's `stream` and its model-thread generator)."""

    _grammars = None  # serving/engine/grammar.py's compiler for this model's tokenizer, made at first use
    _grammars_lock = threading.Lock()  # made once: two first requests must not each build their own

    def check_response_format(self, fmt: ResponseFormat) -> None:
        """Compile `fmt` (cached for the request that asks it): the engine masks its reply's tokens to it."""
        from serving.engine.grammar import GrammarError

        self._require_ready()
        try:
            self._grammar_for(fmt)
        except GrammarError as exc:
            raise InvalidResponseFormat(str(exc)) from None

    def _grammar_for(self, fmt: ResponseFormat):
        from serving.engine.grammar import Grammars

        if self._grammars is None:
            with self._grammars_lock:
                if self._grammars is None:
                    self._grammars = Grammars(self.handle.tokenizer, self.vocab_size, self._eos)
        return self._grammars.compile(fmt.type, fmt.schema)

    def _compiled(self, fmt: ResponseFormat):
        """`fmt`'s compiled grammar (a cache hit once checked, compiled again if evicted since), on the calling
        thread: the request carries it to the model thread, which never compiles (it would stall every row)."""
        from serving.engine.grammar import GrammarError

        try:
            return self._grammar_for(fmt)
        except GrammarError as exc:
            raise InvalidResponseFormat(str(exc)) from None

    def _steps(
        self,
        req: GenerationRequest,
        emit: Callable[[object], None],
        cancel: threading.Event,
        resolved: tuple[object, str | None] = (None, None),
        epoch: int = 0,
        compiled=None,
    ) -> Generator[object, int | None, None]:
        """On the model thread: yield the request's EngineSequence, then take its tokens as the batcher sends them
        (None once it has ended) and emit TokenDelta / GenerationResult / BaseException. Releases the
        request's admission when done, however it ends, before the last item."""
        from kvmem.kv import GenerationStats, Sampling
        from serving.engine.sequence import AdmissionWait, admit

        final: object = None  # the result or the error, sent once the admission is released
        closed = False  # the model loop closed while it ran
        lease = seq = held_adapter = item = None
        try:
            if cancel.is_set():  # the client left while the request waited for its first turn
                return
            # whose K/V its pages are (prefix_cache.py); a delete of the user's after this keeps them out
            # --session-kv-mb 0: no conversation reuse, by session or by prefix. A background (formation)
            # request keeps none: its prompt carries a user's turns under the formation user's id, and its
            # pages would outlive that user's delete (drop_user names the user, not the formation user)
            prefix = None
            if self.sessions.enabled and not req.background:
                prefix = PrefixKey(req.user_id, req.block_item_id, req.adapter_id, epoch)
            item, fallback = resolved  # (the KV item or None, the fallback kind), loaded off this thread
            room = self.max_context_tokens - len(req.prompt.ids)
            max_new = min(req.sampling.max_new_tokens, room)
            sp = req.sampling
            sampling = Sampling(
                max_new_tokens=max(1, max_new),
                temperature=sp.temperature,
                top_p=sp.top_p,
                seed=sp.seed,
                presence_penalty=sp.presence_penalty,
                frequency_penalty=sp.frequency_penalty,
                logit_bias=sp.logit_bias,
                top_logprobs=sp.top_logprobs,
            )
            stats = GenerationStats()
            detok = IncrementalDetokenizer(self.handle.tokenizer)
            # compiled off this thread (`stream`): its own matcher masks its tokens (sampler.py)
            grammar = None if compiled is None else compiled.matcher()
            stops = StopMatcher(sp.stop)
            finish = None
            item, fallback, adapter = with_adapter(self.adapters, req, item, fallback)
            head = None  # no block: the prompt's head, the head item or the stored knowledge (base model K/V)
            if adapter is None:
                if item is None:
                    item = head = self._head_for(req)
                elif req.block_item_id is None or req.prompt.block_len == 0:
                    head = item  # the stored knowledge item (_knowledge_item_for)
            system_head = head is not None and head is self.head_item
            source = None
            # a live session starts from its cache; not under an adapter (its K/V are the adapted model's)
            if req.session_id is not None and req.adapter_id is None and self.sessions.enabled:
                lease = self.sessions.take(req.user_id, req.session_id, req.block_item_id, req.memory_ids)
                # its last turn's pages, by reference (serving/engine/sessions.py)
                source = self._session_pages(lease, item, req.prompt.ids)
            if adapter is not None:  # its tokens get the adapter's delta in the shared step (lora.py)
                self.adapters.hold(adapter)
                held_adapter = adapter
            for got in admit(
                self.pool,
                self.handle.model,
                req.prompt.ids,
                item=item,
                source=source,
                # the prompt's pages cached by the user's earlier requests, found by their tokens (prefix_cache.py)
                prefix=prefix,
                max_new_tokens=sampling.max_new_tokens,
                wait_s=self.config.kv_wait_s,
                # a background row's prompt goes in small chunks while streams decode (EngineSequence.pace)
                prefill_chunk_tokens=BACKGROUND_CHUNK_TOKENS
                if req.background
                else self.config.prefill_chunk_tokens,
                idle_chunk_tokens=self.config.prefill_chunk_tokens if req.background else None,
                background=req.background,
                adapter=adapter,
                sampling=sampling,
                stop_token_ids=self._eos,
                should_stop=cancel.is_set,
                stats=stats,
                grammar=grammar,
            ):
                if isinstance(got, AdmissionWait):  # no room yet: parked until the pool's room changes
                    yield got
                else:
                    seq = got
            if seq is None:  # its client left while it waited for pages
                return
            if source is not None and not seq.table.from_session:  # it waited, and gave its history back
                source = None
            if lease is not None:  # its table references what it reuses of the session's: that one goes now
                self.sessions.started(lease)
            token = yield seq  # the batcher sends each token, then None once the sequence has ended
            held: list[int] = []  # tokens whose text is held back (an incomplete character, a possible stop)
            received = 0  # tokens taken: stats.logprobs[i] is the i-th one's (when asked for)

            def delta(text: str) -> TokenDelta:
                """The held tokens as one delta, with their logprobs; clears them."""
                first = received - len(held)
                lps = stats.logprobs[first:received] if sampling.top_logprobs is not None else []
                out = TokenDelta(text=text, token_ids=tuple(held), logprobs=tuple(map(self._logprob, lps)))
                held.clear()
                return out

            while token is not None:
                if token in self._eos:  # "length" if it ends a JSON reply closed early to fit (sequence.py)
                    finish = seq.finish_reason or "stop"
                    break
                received += 1
                ready, hit = stops.feed(detok.add(token))
                held.append(token)
                if ready:
                    emit(delta(ready))
                if hit:
                    finish = "stop"
                    break
                token = yield  # the next token (one step later) or None; None from a plain turn
            if not stops.hit:  # a character still incomplete at the end: as the full decode has it
                ready, hit = stops.feed(detok.flush())
                if ready:
                    emit(delta(ready))
                finish = "stop" if hit else finish
            if finish != "stop" or not stops.hit:
                tail = stops.flush()
                if tail:
                    emit(delta(tail))
                if held and sampling.top_logprobs is not None:  # tokens with no text (specials) at the end
                    emit(delta(""))
            if finish is None:
                finish = "stop" if stats.finish_reason == "stop" else "length"
            prefix_hit = seq.table.cached_pages > 0
            seq.cache_prefix()  # its full pages, for the user's next request (its next turn)
            if lease is not None:  # its cache holds every token fed: the prompt, all but the last reply token
                cache = seq.keep_table()  # its pages, not a copy
                fed = (*req.prompt.ids, *stats.token_ids)[: cache.get_seq_length()]
                self.sessions.put(lease, fed, cache)
                lease = None
            final = GenerationResult(
                finish_reason=finish,
                prompt_tokens=len(req.prompt.ids),
                # activation memory only: the shared head's tokens are the system prompt, no memory (the
                # stored knowledge item's count, as they do under a block that has it as its parent); with the
                # conversation's pages (a session's, the prefix cache's) every token reused
                cached_tokens=0 if system_head and source is None and not prefix_hit else stats.reused_tokens,
                completion_tokens=len(stats.token_ids),
                ttft_s=stats.ttft_s or 0.0,
                kv_fallback_reason=fallback,
            )
        except GeneratorExit:  # the model loop closed: the stream is told (below), never left waiting
            closed = True
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the event loop, re-raised there
            final = exc
        finally:
            # each release is tried on its own: a failure in one (a bug in the bookkeeping) is logged and never
            # skips the others, the admission's release or the final message, so no client hangs on it
            releases = (
                (lease is not None, lambda: self.sessions.release(lease)),
                (
                    seq is not None,
                    lambda: seq.release(),
                ),  # its pages back to the pool (its table, or the rest)
                # a block deleted after this request resolved it and before its admission put it back in the
                # pool: it leaves the pool now that its reader is done (backend.py `_unpool`)
                (item is not None, lambda: self._unpool_if_gone(item.item_id)),
                (
                    held_adapter is not None,
                    lambda: self.adapters.unhold(held_adapter),
                ),  # an erased one unloads
            )
            for due, release in releases:
                if due:
                    try:
                        release()
                    except Exception:  # noqa: BLE001 - logged; the request still ends
                        log.exception("request %s: releasing what it held failed", req.request_id)
            self._release()
            if closed:  # raising out of here: the last word now
                emit(BackendError("the model loop closed while this request ran"))
        if final is not None:  # after the release: a client may send its next request as soon as it sees this
            emit(final)

    def _session_pages(self, lease, item, prompt_ids) -> tuple[object, int] | None:
        """(the page table the session's last turn left, the prompt tokens it covers) when it covers more of
        the prompt than the block item does, else None (the request starts from the item)."""
        from kvmem.kv.inject import usable_prefix_tokens

        reused = max(usable_prefix_tokens(item, prompt_ids), 0) if item is not None else 0
        n = self.sessions.reuse(lease, prompt_ids, reused)
        self.sessions.trim(lease, n)  # what it does not read goes back before it waits for pages
        return (lease.entry.cache, n) if n else None

    def _logprob(self, lp) -> TokenLogprob:
        """A kvmem.kv.sampling.TokenLogprobs (ids) as the wire's TokenLogprob (texts and bytes)."""
        text, raw = self._pieces(lp.token_id)
        top = []
        for token_id, logprob in lp.top:
            top_text, top_raw = self._pieces(token_id)
            top.append(TopLogprob(top_text, logprob, top_raw))
        return TokenLogprob(text, lp.logprob, raw, tuple(top))

    async def stream(
        self, req: GenerationRequest, is_disconnected: Callable[[], Awaitable[bool]] | None = None
    ) -> AsyncIterator[StreamItem]:
        self._require_ready()
        self._admit()
        inbox = Inbox(asyncio.get_running_loop())
        cancel = threading.Event()
        handoff = self._loop.handoff  # the model loop hands a turn's items over at once (handoff.py)

        def emit(obj: object) -> None:
            handoff.put(inbox, obj)

        started = time.perf_counter()
        try:
            # the user's deletes and the block's drops so far, read before the block is resolved: one after this
            # keeps the request's pages out of the prefix cache (it may serve what it took: prefix_cache.py)
            epoch = self.pool.prefix.epoch(req.user_id, req.block_item_id) if self.pool is not None else 0
            resolved = await self._resolve_off_model_thread(req)
            fmt, compiled = req.sampling.response_format, None
            if fmt is not None:  # cached since the check; carried to the model thread, not looked up there
                compiled = await asyncio.to_thread(self._compiled, fmt)
            self._loop.start(self._steps(req, emit, cancel, resolved, epoch, compiled))
        except BaseException:
            self._release()
            raise
        try:
            asked = time.monotonic()
            while True:
                # everything the model thread sent since the last take (several items when this reader fell
                # behind); whether the client left is asked every 0.25 s, not per token (it costs ~50 us; a
                # stream's response also watches for the disconnect itself)
                batch = await inbox.take(0.25)
                if not batch and not self._loop.thread.is_alive():  # closed: what it said last is delivered
                    batch = await inbox.take(0.05)  # by now (its final flush), or it never started
                    if not batch:
                        raise BackendError("the model loop closed before this request ended")
                last = len(batch) - 1
                for i, obj in enumerate(batch):
                    if isinstance(obj, PoolFull | PoolTooSmall):  # 429 (no pages in kv_wait_s), 400 (never)
                        raise obj
                    if isinstance(obj, BaseException):
                        raise BackendError(f"generation failed: {obj}") from obj
                    if i < last and isinstance(obj, TokenDelta):  # its SSE chunk goes out with the next's
                        obj = replace(obj, more=True)
                    yield obj
                    if isinstance(obj, GenerationResult):
                        return
                if is_disconnected is None or time.monotonic() - asked < 0.25:
                    continue
                asked = time.monotonic()
                if await is_disconnected():
                    log.info("client disconnected; stopping request %s", req.request_id)
                    return
        finally:
            cancel.set()
            self._loop.wake()  # a request parked for pages sees its client left and frees its slot now
            log.debug("request %s held the backend for %.3fs", req.request_id, time.perf_counter() - started)

"""A deterministic fake backend for HTTP plumbing tests and demos without a model.

One character is one token (id = code point). The reply is scripted; every request is recorded so tests can
read the exact prompt a user was answered from. Readiness, per-token delay, a hold gate and a bounded queue
are controllable, so 503, 429 and client disconnects can be tested. It says nothing about a real model.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from serving.backends.base import (
    SAMPLING_FEATURES,
    Backend,
    BlockNotFound,
    GenerationRequest,
    GenerationResult,
    LaidOutPrompt,
    NotReady,
    PromptTooLong,
    QueueFull,
    StreamItem,
    TokenDelta,
    TokenLogprob,
    TopLogprob,
)
from serving.engine.stops import StopMatcher

if TYPE_CHECKING:
    from kvmem.kv.blocks import BuiltBlock

logger = logging.getLogger(__name__)

SYSTEM_PROMPT = "You are a helpful assistant with long-term memory."


def fake_logprob(ch: str, top: int) -> TokenLogprob:
    """A character's made-up log-probability: -0.25, and its top list: itself, then the next code points at
    -1.25, -2.25, ... (so tests can state the exact JSON)."""
    tops = tuple(
        TopLogprob(chr(ord(ch) + j), -0.25 - j, tuple(chr(ord(ch) + j).encode("utf-8", "surrogatepass")))
        for j in range(top)
    )
    return TokenLogprob(ch, -0.25, tuple(ch.encode("utf-8", "surrogatepass")), tops)


@dataclass(frozen=True)
class FakeOutcome:
    """How one recorded request ended: "completed", "disconnected" (callback said so) or "closed"."""

    request_id: str
    how: str
    num_tokens: int


class FakeBackend(Backend):
    """Scripted replies over a character tokenizer. Not thread-safe beyond what the HTTP tests need."""

    name = "fake"
    serves_adapters = True  # it stands in for a backend that serves adapters but builds no block under one
    # accepted for the HTTP plumbing (the reply is scripted: tests read them from `requests`); its logprobs are
    # fake_logprob's
    sampling_features = frozenset(SAMPLING_FEATURES) - {"response_format"}  # a scripted reply has no grammar
    vocab_size = 0x110000  # code points

    def __init__(
        self,
        *,
        reply: str | Callable[[GenerationRequest], str] = "Hello from kvmem.",
        model_id: str = "kvmem-fake",
        max_context_tokens: int = 4096,
        queue_size: int = 8,
        token_delay_s: float = 0.0,
        ready: bool = True,
        ready_on_load: bool = True,
    ) -> None:
        self.model_id = model_id
        self.max_context_tokens = max_context_tokens
        self.reply = reply
        self.queue_size = queue_size
        self.token_delay_s = token_delay_s
        self._ready = ready
        self.ready_on_load = ready_on_load
        self._lock = threading.Lock()
        self._blocks: dict[str, tuple[int, ...]] = {}
        self._owners: dict[str, tuple[str, tuple[str, ...]]] = {}  # item id -> (user id, memory ids)
        self._corrupt: set[str] = set()
        self._drop_listeners: list[Callable[[str, str, str], None]] = []
        self.num_in_flight = 0
        self.requests: list[GenerationRequest] = []
        self.outcomes: list[FakeOutcome] = []
        self.built: list[tuple[str, tuple[str, ...]]] = []
        self.block_ids_given = 0  # layouts that were handed the block's ids by a plan (none re-tokenized)
        self.hold = threading.Event()  # while set, generation waits before each token (tests release it)

    # -- controls for tests --------------------------------------------------------------------------------
    def set_ready(self, ready: bool) -> None:
        self._ready = ready

    def corrupt(self, item_id: str) -> None:
        """Make `item_id` unusable, as a corrupt file would: requests using it fall back to full prefill."""
        self._corrupt.add(item_id)

    def evict(self, item_id: str) -> None:
        """Drop `item_id` as a store over its budget would, and report it to the drop listeners."""
        with self._lock:
            self._blocks.pop(item_id, None)
            user_id, _ = self._owners.pop(item_id, ("", ()))
            listeners = list(self._drop_listeners)
        for callback in listeners:
            callback(item_id, user_id, "evicted")

    @staticmethod
    def decode(ids: Sequence[int]) -> str:
        return "".join(chr(i) for i in ids)

    # -- Backend -------------------------------------------------------------------------------------------
    def load(self) -> None:
        if self.ready_on_load:
            self._ready = True

    def is_ready(self) -> bool:
        return self._ready

    def count_tokens(self, text: str) -> int:
        return len(text)

    def _block_text(self, block_texts: Sequence[str]) -> str:
        if not block_texts:
            return ""
        return f"<system>{SYSTEM_PROMPT}\n[memory]\n" + "".join(f"- {t}\n" for t in block_texts)

    def layout_prompt(
        self,
        block_texts: Sequence[str],
        text_texts: Sequence[str],
        messages: Sequence[dict[str, str]],
        block_ids: Sequence[int] | None = None,
    ) -> LaidOutPrompt:
        block = self._block_text(block_texts)
        head = "" if block else f"<system>{SYSTEM_PROMPT}\n"
        texts = "".join(f"[memory] {t}\n" for t in text_texts)
        history = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        ids = tuple(ord(c) for c in block + head + texts + history + "<assistant>")
        if block_ids is not None and tuple(block_ids) != ids[: len(block)]:
            raise ValueError("block_ids are not the ids of block_texts")  # a plan out of step with its texts
        self.block_ids_given += block_ids is not None
        if len(ids) >= self.max_context_tokens:
            raise PromptTooLong(len(ids), self.max_context_tokens)
        return LaidOutPrompt(ids=ids, block_len=len(block))

    def build_block(
        self, user_id: str, block_texts: Sequence[str], memory_ids: Sequence[str] | None = None
    ) -> BuiltBlock:
        from kvmem.kv.blocks import BuiltBlock  # here: kvmem.kv loads torch, which plumbing alone never needs

        if not self._ready:
            raise NotReady("fake backend is not ready")
        ids = tuple(ord(c) for c in self._block_text(block_texts))
        digest = hashlib.sha256(("\x00".join([user_id, *block_texts])).encode()).hexdigest()[:16]
        item_id = f"kv-{digest}"
        with self._lock:
            self._blocks[item_id] = ids
            self._owners[item_id] = (user_id, tuple(memory_ids or ()))
            self.built.append((user_id, tuple(block_texts)))
        memory_ids = tuple(memory_ids) if memory_ids is not None else ()
        return BuiltBlock(item_id, memory_ids, len(ids), len(ids) * 4, built=True, token_ids=ids)

    def drop_block(self, item_id: str) -> None:
        with self._lock:
            self._blocks.pop(item_id, None)
            self._owners.pop(item_id, None)
            self._corrupt.discard(item_id)  # a rebuilt item under the same id is a fresh one

    def has_block(self, item_id: str) -> bool:
        with self._lock:
            return item_id in self._blocks

    def forget(self, user_id: str, memory_ids: Sequence[str] | None = None) -> list[str]:
        wanted = None if memory_ids is None else set(memory_ids)
        with self._lock:
            ids = sorted(
                i
                for i, (user, mids) in self._owners.items()
                if user == user_id and (wanted is None or not wanted.isdisjoint(mids))
            )
            for item_id in ids:
                self._blocks.pop(item_id, None)
                self._owners.pop(item_id, None)
        return ids

    def subscribe_dropped(self, callback: Callable[[str, str, str], None]) -> Callable[[], None]:
        with self._lock:
            self._drop_listeners.append(callback)
        return lambda: self._drop_listeners.remove(callback) if callback in self._drop_listeners else None

    def _cached(self, req: GenerationRequest, stored: tuple[int, ...] | None) -> tuple[int, str | None]:
        """(prompt tokens served from the block, the fallback kind or None); `stored`: the block's ids."""
        if stored is None:
            return 0, None
        if req.block_item_id in self._corrupt:
            reason = "corrupt"
        elif stored != req.prompt.ids[: req.prompt.block_len]:
            reason = "prefix_mismatch"
        else:
            return req.prompt.block_len, None
        logger.warning("KV item %s unusable (%s): full prefill", req.block_item_id, reason)
        return 0, reason

    async def stream(
        self, req: GenerationRequest, is_disconnected: Callable[[], Awaitable[bool]] | None = None
    ) -> AsyncIterator[StreamItem]:
        if not self._ready:
            raise NotReady("fake backend is not ready")
        with self._lock:
            stored = None  # the block's ids, read once: what a real backend would have loaded
            if req.block_item_id is not None and req.prompt.block_len:
                stored = self._blocks.get(req.block_item_id)
                if stored is None:  # as the real backends: refused before anything is recorded or generated
                    logger.warning(
                        "KV item %s is not stored: request %s refused", req.block_item_id, req.request_id
                    )
                    raise BlockNotFound(req.block_item_id)
            if self.num_in_flight >= self.queue_size:
                raise QueueFull(f"queue full ({self.queue_size} requests in flight)")
            self.num_in_flight += 1
            self.requests.append(req)
        start = time.perf_counter()
        how, produced = "closed", 0
        try:
            cached, fallback = self._cached(req, stored)
            reply = self.reply(req) if callable(self.reply) else self.reply
            room = self.max_context_tokens - len(req.prompt.ids)
            limit = min(req.sampling.max_new_tokens, room)
            finish, ttft, stops = "stop", 0.0, StopMatcher(req.sampling.stop)
            for ch in reply:
                if produced >= limit:
                    finish = "length"
                    break
                while self.hold.is_set():
                    await asyncio.sleep(0.005)
                if self.token_delay_s:
                    await asyncio.sleep(self.token_delay_s)
                if is_disconnected is not None and await is_disconnected():
                    how = "disconnected"
                    return
                produced += 1
                ttft = ttft or time.perf_counter() - start
                ready, hit = stops.feed(ch)
                if ready:
                    yield self._delta(ready, req)
                if hit:
                    break
            tail = "" if stops.hit else stops.flush()
            if tail:
                yield self._delta(tail, req)
            how = "completed"
            yield GenerationResult(
                finish_reason=finish,
                prompt_tokens=len(req.prompt.ids),
                cached_tokens=cached,
                completion_tokens=produced,
                ttft_s=ttft,
                kv_fallback_reason=fallback,
            )
        finally:
            with self._lock:
                self.num_in_flight -= 1
                self.outcomes.append(FakeOutcome(req.request_id, how, produced))

    @staticmethod
    def _delta(text: str, req: GenerationRequest) -> TokenDelta:
        top = req.sampling.top_logprobs
        logprobs = () if top is None else tuple(fake_logprob(c, top) for c in text)
        return TokenDelta(text=text, token_ids=tuple(ord(c) for c in text), logprobs=logprobs)

    async def aclose(self) -> None:
        self.hold.clear()

"""Preparing a chat request: plan + search -> prompt ids, checked against the store before it is served.

Owns what a request carries (`PreparedChat`: the backend request, the memories used and their tiers, the
admission generation) and the check that none of its memories was deleted or changed while it was prepared.
Knows nothing of HTTP, of generation or of what happens after the turn (serving/chat/service.py).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass
from typing import Any

from kvmem.errors import DependencyUnavailable
from scheduler import Scheduler
from scheduler.plan import Plan
from serving.backends.base import Backend, GenerationRequest, GenerationResult, SamplingParams
from serving.chat.openai_params import sampling_extras
from serving.config import ServingConfig
from serving.http.protocol import ApiError, ChatCompletionRequest, bad_request

logger = logging.getLogger(__name__)

# Preparations of one request whose carried memories were deleted or changed meanwhile before it is refused
# (503 memories_changed): each one leaves out what the previous found stale, so only new changes repeat it.
MAX_PREPARES = 3


@dataclass(frozen=True)
class UsedMemory:
    id: str
    tier: str  # "kv" | "text" | "lora"


@dataclass(frozen=True)
class PreparedChat:
    """Everything decided before generation: the backend request and the memories it carries."""

    request: GenerationRequest
    session_id: str | None
    query: str
    used: tuple[UsedMemory, ...]  # what the prompt carried (the response's `memory.used`): block + text hits
    retrieved_ids: tuple[str, ...]  # search hits over all the user's memories, best first: heat counts these
    started_at: float  # perf_counter at request arrival, for TTFT through HTTP
    body: ChatCompletionRequest  # what the client sent: the request is prepared again from it (BlockNotFound)
    # the user's store generation when the request was admitted (MemoryStore.generation): its turn is not
    # logged if the user was wholly deleted since (MemoryStore.log_turns' admitted_generation)
    admitted_generation: int | None = None

    def memory_dict(self, result: GenerationResult | None) -> dict[str, Any]:
        """The `memory` extension. A block that fell back to prefill was served as text."""
        fell_back = result is not None and result.kv_fallback_reason is not None
        tiers = [("text" if fell_back and m.tier == "kv" else m.tier) for m in self.used]
        return {"used": [{"id": m.id, "tier": t} for m, t in zip(self.used, tiers, strict=True)]}


def memories_changed() -> ApiError:
    """503 memories_changed: the request's memories kept changing under each of its MAX_PREPARES preparations."""
    return ApiError(
        503,
        "the user's memories kept changing while this request was prepared; retry",
        type="server_error",
        code="memories_changed",
    )


class ChatPreparer:
    """Prepares requests for ChatService: reads the scheduler's plan (never waits on its worker), searches
    the store and lays the prompt out through the backend, all in threads off the event loop."""

    def __init__(self, config: ServingConfig, backend: Backend, store: Any, scheduler: Scheduler) -> None:
        self._config, self._backend, self._store, self._scheduler = config, backend, store, scheduler

    async def prepare(
        self,
        user_id: str,
        session_id: str | None,
        body: ChatCompletionRequest,
        started_at: float,
        *,
        gone_block: str | None = None,
        admitted: int | None = None,
    ) -> PreparedChat:
        """Plan + search + layout, then a check that every memory the prompt carries as text or as the block's
        tokens is still served with the same text (one store read, after the layout): a memory deleted or
        changed while the request was prepared is left out and the request prepared again, so a request
        prepared before a delete never serves the deleted text (not even as the prefill of a block the cascade
        dropped). Raises PromptTooLong (400) when the prompt leaves no room to answer, ApiError 503
        memories_changed when its memories changed under each of MAX_PREPARES preparations.
        A request prepared again because its block item was gone (BlockNotFound) passes `gone_block` (that item
        is not used: a plan still naming it carries its memories as text, checked like any) and the generation
        it was `admitted` at."""
        messages = [m.to_plain() for m in body.messages]
        query = next(m["content"] for m in reversed(messages) if m["role"] == "user")
        dead: frozenset[str] = frozenset()
        for _ in range(MAX_PREPARES):
            prepared, stale, generation = await self._prepare_once(
                user_id, session_id, body, messages, query, started_at, admitted, dead, gone_block
            )
            admitted = generation if admitted is None else admitted
            if not stale:
                return prepared
            logger.info(
                "request %s: memories %s changed while it was prepared; preparing it again without them",
                prepared.request.request_id,
                sorted(stale),
            )
            dead |= stale
        raise memories_changed()

    async def _prepare_once(
        self,
        user_id: str,
        session_id: str | None,
        body: ChatCompletionRequest,
        messages: list[dict[str, Any]],
        query: str,
        started_at: float,
        admitted: int | None,
        dead: frozenset[str],
        gone_block: str | None,
    ) -> tuple[PreparedChat, frozenset[str], int]:
        """One preparation, leaving out the memories in `dead` and the block item `gone_block`: the request, the
        memories it carries that are no longer served as it carries them (empty: it may be served), and the
        store generation read before its search (the admission generation, on the first)."""
        # a chat message may be far longer than a search query may be: search with its last max_query_chars
        # characters (where a question usually is), so one huge message cannot make the full-text query, and
        # every other user's search behind it, arbitrarily expensive
        search_query = query[-self._config.limits.max_query_chars :] if query.strip() else None
        plan, generation, hits = await asyncio.to_thread(self._plan_and_search, user_id, search_query)
        block = plan.block
        covered = plan.covered_ids
        lora_ids = plan.adapter.memory_ids if plan.adapter else ()
        text_hits = [h for h in hits if h.memory.id not in covered and h.memory.id not in dead]
        block_texts: list[str] = []
        if block is not None and (
            block.adapter != (plan.adapter.name if plan.adapter else None)
            or not dead.isdisjoint(block.memory_ids)
            or block.item_id == gone_block
        ):
            # the block's K/V were computed under another adapter (or none), it holds a memory deleted since, or
            # the backend no longer has it: not injected; what it holds beyond the adapter's facts (and what is
            # gone) goes in as text (the scheduler's get already leaves such blocks out; the delete cascade and
            # report_unservable withdraw the others)
            kept = [
                (i, t)
                for i, t in zip(block.memory_ids, block.texts, strict=True)
                if i not in lora_ids and i not in dead
            ]
            block_texts = [t for _, t in kept]
            block_ids = [i for i, _ in kept]
            block = None
        else:
            block_ids = []
        carried = dict(zip(block.memory_ids, block.texts, strict=True)) if block else {}
        carried.update(zip(block_ids, block_texts, strict=True))
        carried.update((h.memory.id, h.memory.text) for h in text_hits)
        prompt, stale = await asyncio.to_thread(
            self._layout_and_check,
            user_id,
            carried,
            block.texts if block else (),
            block_texts + [h.memory.text for h in text_hits],
            messages,
            (block.token_ids or None) if block else None,
        )
        room = self._backend.max_context_tokens - len(prompt.ids)
        wanted = body.max_completion_tokens or body.max_tokens or self._config.default_max_tokens
        if (body.max_completion_tokens or body.max_tokens) and wanted > room:  # asked for: refused, as OpenAI
            field = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
            raise bad_request(
                f"{field} is {wanted} and the prompt has {len(prompt.ids)} tokens; the model's context length "
                f"is {self._backend.max_context_tokens} tokens, so at most {room} can be generated: lower "
                f"{field}",
                param=field,
                code="context_length_exceeded",
            )
        sampling = SamplingParams(
            max_new_tokens=max(1, min(wanted, room)),
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            stop=body.stop_strings(),
            seed=body.seed,
            **sampling_extras(body, self._backend.vocab_size),
        )
        used = (
            tuple(UsedMemory(i, "kv") for i in (block.memory_ids if block else ()))
            + tuple(UsedMemory(i, "lora") for i in lora_ids)
            + tuple(UsedMemory(i, "text") for i in block_ids)
            + tuple(UsedMemory(h.memory.id, "text") for h in text_hits)
        )
        request = GenerationRequest(
            request_id=f"chatcmpl-{uuid.uuid4().hex}",
            user_id=user_id,
            prompt=prompt,
            block_item_id=block.item_id if block and prompt.block_len else None,
            sampling=sampling,
            adapter_id=plan.adapter_id,
            session_id=session_id,  # the backend may keep this conversation's KV for its next turn
            memory_ids=tuple(u.id for u in used),
        )
        prepared = PreparedChat(
            request=request,
            session_id=session_id,
            query=query,
            used=used,
            retrieved_ids=tuple(h.memory.id for h in hits if h.memory.id not in dead),
            started_at=started_at,
            body=body,
            admitted_generation=generation if admitted is None else admitted,
        )
        return prepared, stale, generation

    def _plan_and_search(self, user_id: str, search_query: str | None) -> tuple[Plan, int | None, list[Any]]:
        """The scheduler's plan, the user's store generation (the request's admission) and the search's hits,
        in that order, on a thread: the plan read may wait (with replicas it reads the shared fence in Redis,
        with a socket timeout; a retraction takes the worker's lock), and the event loop must not. The plan's
        block starts coming toward the device as soon as it is known (a read from disk under way while the
        search, the layout and the admission run: Backend.prefetch_block)."""
        plan = self._scheduler.get(user_id)
        if plan.block is not None:
            self._backend.prefetch_block(plan.block.item_id)
        try:
            generation = self._store.generation(user_id)
            if search_query is None:
                return plan, generation, []
            return (
                plan,
                generation,
                self._store.search(user_id, search_query, top_k=self._config.retrieve_top_k),
            )
        except DependencyUnavailable as exc:
            # the store's server is away: serve what is resident (the plan's block, its adapter) without the
            # search's text. Safe: nothing can change the memories while no one can write them, and a change a
            # peer made before the outage fenced the block off already (Scheduler.get)
            logger.warning("serving %s without a search: %s", user_id, exc)
            return plan, None, []

    def _layout_and_check(
        self,
        user_id: str,
        carried: dict[str, str],
        block_texts: Any,
        text_texts: list[str],
        messages: list[dict[str, Any]],
        block_ids: Any,
    ) -> tuple[Any, frozenset[str]]:
        """The prompt, then which `carried` memories (id -> the text the prompt holds) are no longer served with
        that text (deleted, changed, archived or superseded): read after the layout, the last step before the
        request is handed to the backend."""
        prompt = self._backend.layout_prompt(block_texts, text_texts, messages, block_ids)
        if not carried:
            return prompt, frozenset()
        try:
            live = {m.id: m for m in self._store.memories_by_ids(user_id, list(carried))}
        except DependencyUnavailable:  # the store's server is away: no one can have changed them since
            return prompt, frozenset()
        stale = frozenset(
            i
            for i, text in carried.items()
            if (m := live.get(i)) is None or not m.is_served or m.text != text
        )
        return prompt, stale

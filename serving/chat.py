"""The chat path: plan + search -> prompt ids -> backend stream -> OpenAI JSON or SSE; then store the turn.

Composes the scheduler (plans, access events), the plaintext store and the backend; computes nothing itself. Owns the order of
a turn and what happens after it (turn logged and queued for formation, access event sent) without making the response wait for it.
Knows nothing of auth or routing: it is handed a user id it may serve.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from scheduler import Scheduler, turn_access
from scheduler.formation import FormationWorker
from serving.backends.base import (
    Backend,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    StreamItem,
    TokenDelta,
    TokenLogprob,
)
from serving.config import DEFAULT_MODEL, ServingConfig
from serving.limits import check_chat
from serving.metrics import Metrics
from serving.openai_params import check_params, sampling_extras
from serving.protocol import (
    ApiError,
    ChatCompletionRequest,
    bad_request,
    chunk_dict,
    completion_dict,
    logprobs_dict,
    usage_dict,
)

logger = logging.getLogger(__name__)

MAX_STOP_STRINGS = 4  # as OpenAI
# Characters per stop string: stop strings are short markers ("\n\n", "User:", "</answer>"); the cap bounds
# the text a backend holds back and its matcher's work per token (serving/backends/stops.py).
MAX_STOP_CHARS = 64
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts
# Preparations of one request whose carried memories were deleted or changed meanwhile before it is refused
# (503 memories_changed): each one leaves out what the previous found stale, so only new changes repeat it.
MAX_PREPARES = 3

IsDisconnected = Callable[[], Awaitable[bool]]


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
    # the user's store generation when the request was admitted (MemoryStore.generation): its turn is not
    # logged if the user was wholly deleted since (MemoryStore.log_turns' admitted_generation)
    admitted_generation: int | None = None

    def memory_dict(self, result: GenerationResult | None) -> dict[str, Any]:
        """The `memory` extension. A block that fell back to prefill was served as text."""
        fell_back = result is not None and result.kv_fallback_reason is not None
        tiers = [("text" if fell_back and m.tier == "kv" else m.tier) for m in self.used]
        return {"used": [{"id": m.id, "tier": t} for m, t in zip(self.used, tiers, strict=True)]}


class ChatService:
    def __init__(
        self,
        config: ServingConfig,
        backend: Backend,
        store: Any,
        scheduler: Scheduler,
        metrics: Metrics,
        formation: FormationWorker | None = None,
    ) -> None:
        self._config, self._backend, self._store, self._scheduler, self._metrics = (
            config,
            backend,
            store,
            scheduler,
            metrics,
        )
        self._formation = formation  # forms memories from the logged turns, in the background
        self._background: set[asyncio.Future[Any]] = set()
        # (user, session) pairs seen, least recent first, for prewarm on a session's first turn: at most
        # config.max_sessions (the header is the client's choice); a forgotten session that returns prewarms
        # again. Touched only on the event loop, so no lock.
        self._sessions: OrderedDict[tuple[str, str], None] = OrderedDict()

    # -- before generation -----------------------------------------------------------------------------------
    def validate(self, body: ChatCompletionRequest) -> None:
        """Checks the request beyond its schema. Raises ApiError (400/404)."""
        # "default" names whatever this server serves (the README's calls use it, whatever --model is)
        if body.model not in (self._backend.model_id, self._config.model, DEFAULT_MODEL):
            raise ApiError(
                404,
                f"the model {body.model!r} does not exist; this server serves {self._backend.model_id!r}",
                type="invalid_request_error",
                param="model",
                code="model_not_found",
            )
        if body.n is not None and body.n != 1:
            raise bad_request(f"only n=1 is supported, got n={body.n}", param="n", code="unsupported_value")
        stops = body.stop_strings()
        if len(stops) > MAX_STOP_STRINGS:
            raise bad_request(f"at most {MAX_STOP_STRINGS} stop strings are allowed", param="stop")
        for i, stop in enumerate(stops):
            if len(stop) > MAX_STOP_CHARS:
                raise bad_request(
                    f"stop[{i}] has {len(stop)} characters, "
                    f"over the limit of {MAX_STOP_CHARS} per stop string",
                    param="stop",
                    code="string_above_max_length",
                )
        if body.seed is not None and not SEED_RANGE[0] <= body.seed <= SEED_RANGE[1]:
            raise bad_request(f"seed must be in [{SEED_RANGE[0]}, {SEED_RANGE[1]}]", param="seed")
        check_params(
            body,
            backend_name=self._backend.name,
            sampling_features=self._backend.sampling_features,
            vocab_size=self._backend.vocab_size,
        )
        if not any(m.role == "user" for m in body.messages):
            raise bad_request("messages must contain at least one user message", param="messages")
        check_chat(body, self._config.limits)

    async def prepare(
        self, user_id: str, session_id: str | None, body: ChatCompletionRequest, started_at: float
    ) -> PreparedChat:
        """Plan + search + layout, then a check that every memory the prompt carries as text or as the block's
        tokens is still served with the same text (one store read, after the layout): a memory deleted or
        changed while the request was prepared is left out and the request prepared again, so a request
        prepared before a delete never serves the deleted text (not even as the prefill of a block the cascade
        dropped). Raises PromptTooLong (400) when the prompt leaves no room to answer, ApiError 503
        memories_changed when its memories changed under each of MAX_PREPARES preparations."""
        messages = [m.to_plain() for m in body.messages]
        query = next(m["content"] for m in reversed(messages) if m["role"] == "user")
        if session_id is not None and self._first_turn(user_id, session_id):
            self._scheduler.session_start(user_id)  # a new session: prewarm (next-scene prediction)
        admitted: int | None = None
        dead: frozenset[str] = frozenset()
        for _ in range(MAX_PREPARES):
            prepared, stale, generation = await self._prepare_once(
                user_id, session_id, body, messages, query, started_at, admitted, dead
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
        raise ApiError(
            503,
            "the user's memories kept changing while this request was prepared; retry",
            type="server_error",
            code="memories_changed",
        )

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
    ) -> tuple[PreparedChat, frozenset[str], int]:
        """One preparation, leaving out the memories in `dead`: the request, the memories it carries that are no
        longer served as it carries them (empty: it may be served), and the store generation read before its
        search (the admission generation, on the first)."""
        plan = self._scheduler.get(user_id)
        block = plan.block
        # a chat message may be far longer than a search query may be: search with its last max_query_chars
        # characters (where a question usually is), so one huge message cannot make the full-text query, and
        # every other user's search behind it, arbitrarily expensive
        search_query = query[-self._config.limits.max_query_chars :] if query.strip() else None
        generation, hits = await asyncio.to_thread(self._admit_and_search, user_id, search_query)
        covered = plan.covered_ids
        lora_ids = plan.adapter.memory_ids if plan.adapter else ()
        text_hits = [h for h in hits if h.memory.id not in covered and h.memory.id not in dead]
        block_texts: list[str] = []
        if block is not None and (
            block.adapter != (plan.adapter.name if plan.adapter else None)
            or not dead.isdisjoint(block.memory_ids)
        ):
            # the block's K/V were computed under another adapter (or none), or it holds a memory deleted since:
            # not injected; what it holds beyond the adapter's facts (and what is gone) goes in as text (the
            # scheduler's get already leaves such blocks out; the delete cascade withdraws the other)
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
            admitted_generation=generation if admitted is None else admitted,
        )
        return prepared, stale, generation

    def _admit_and_search(self, user_id: str, search_query: str | None) -> tuple[int, list[Any]]:
        """The user's store generation (read first: the request's admission), then the search's hits."""
        generation = self._store.generation(user_id)
        if search_query is None:
            return generation, []
        return generation, self._store.search(user_id, search_query, top_k=self._config.retrieve_top_k)

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
        live = {m.id: m for m in self._store.memories_by_ids(user_id, list(carried))}
        stale = frozenset(
            i
            for i, text in carried.items()
            if (m := live.get(i)) is None or not m.is_served or m.text != text
        )
        return prompt, stale

    @property
    def sessions(self) -> tuple[tuple[str, str], ...]:
        """The (user, session) pairs remembered, least recently seen first."""
        return tuple(self._sessions)

    def _first_turn(self, user_id: str, session_id: str) -> bool:
        """Remember the session (most recent now); True if it was not remembered (new, or forgotten)."""
        key = (user_id, session_id)
        if key in self._sessions:
            self._sessions.move_to_end(key)
            return False
        self._sessions[key] = None
        while len(self._sessions) > self._config.max_sessions:
            self._sessions.popitem(last=False)
        return True

    # -- generation -------------------------------------------------------------------------------------------
    async def _generate(
        self, prepared: PreparedChat, is_disconnected: IsDisconnected | None
    ) -> AsyncIterator[StreamItem]:
        """The backend stream with metrics around it; stores the turn once it completes."""
        self._metrics.change_in_flight(+1)
        text: list[str] = []
        first = True
        try:
            async with aclosing(self._backend.stream(prepared.request, is_disconnected)) as stream:
                async for item in stream:
                    if first:
                        self._metrics.observe_ttft(time.perf_counter() - prepared.started_at)
                        first = False
                    if isinstance(item, TokenDelta):
                        text.append(item.text)
                    else:
                        self._after_turn(prepared, "".join(text), item)
                    yield item
        finally:
            self._metrics.change_in_flight(-1)

    async def complete(
        self, prepared: PreparedChat, model: str, is_disconnected: IsDisconnected | None
    ) -> dict:
        """A non-streaming answer as a `chat.completion` dict."""
        text: list[str] = []
        logprobs: list[TokenLogprob] = []
        result: GenerationResult | None = None
        async with aclosing(self._generate(prepared, is_disconnected)) as items:
            async for item in items:
                if isinstance(item, TokenDelta):
                    text.append(item.text)
                    logprobs.extend(item.logprobs)
                else:
                    result = item
        if result is None:  # the client went away; nobody reads this
            raise ApiError(
                499, "client disconnected", type="invalid_request_error", code="client_disconnected"
            )
        return completion_dict(
            completion_id=prepared.request.request_id,
            created=int(time.time()),
            model=model,
            content="".join(text),
            finish_reason=result.finish_reason,
            usage=usage_dict(result.prompt_tokens, result.completion_tokens, result.cached_tokens),
            memory=prepared.memory_dict(result),
            logprobs=logprobs_dict(logprobs) if prepared.request.sampling.top_logprobs is not None else None,
        )

    async def open_stream(
        self, prepared: PreparedChat, model: str, include_usage: bool, is_disconnected: IsDisconnected | None
    ) -> AsyncIterator[str]:
        """SSE lines of a streamed answer. Waits for the first backend item before returning, so queue-full,
        not-ready and backend errors still become proper HTTP errors rather than a broken 200 stream."""
        items = self._generate(prepared, is_disconnected)
        try:
            first = await anext(items)
        except BaseException:
            await items.aclose()
            raise
        return self._sse(prepared, model, include_usage, first, items)

    async def _sse(
        self,
        prepared: PreparedChat,
        model: str,
        include_usage: bool,
        first: StreamItem,
        items: AsyncIterator[StreamItem],
    ) -> AsyncIterator[str]:
        created = int(time.time())

        def event(delta: dict | None, **kw: Any) -> str:
            chunk = chunk_dict(
                completion_id=prepared.request.request_id,
                created=created,
                model=model,
                delta=delta,
                with_usage_field=include_usage,
                **kw,
            )
            return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"

        async def chained() -> AsyncIterator[StreamItem]:
            yield first
            async for item in items:
                yield item

        try:
            yield event({"role": "assistant", "content": ""})
            async for item in chained():
                if isinstance(item, TokenDelta):
                    if item.logprobs:  # a token whose text is not complete yet still brings its logprob
                        yield event({"content": item.text}, logprobs=logprobs_dict(item.logprobs))
                    elif item.text:
                        yield event({"content": item.text})
                    continue
                yield event({}, finish_reason=item.finish_reason, memory=prepared.memory_dict(item))
                if include_usage:
                    usage = usage_dict(item.prompt_tokens, item.completion_tokens, item.cached_tokens)
                    yield event(None, usage=usage)
            yield "data: [DONE]\n\n"
        except ApiError as e:
            yield f"data: {json.dumps(e.to_dict())}\n\n"
        except Exception:
            logger.exception("stream %s failed after it started", prepared.request.request_id)
            error = ApiError(
                500, "the backend failed while streaming", type="server_error", code="backend_error"
            )
            yield f"data: {json.dumps(error.to_dict())}\n\n"
        finally:
            await items.aclose()  # type: ignore[attr-defined]

    # -- after the turn ---------------------------------------------------------------------------------------
    def _after_turn(self, prepared: PreparedChat, reply: str, result: GenerationResult) -> None:
        """Metrics now; the turn and the access event off the response path."""
        self._metrics.observe_generation(
            result.prompt_tokens, result.cached_tokens, result.kv_fallback_reason
        )
        if result.ttft_s > 0:  # 0: nothing was generated
            self._metrics.observe_prefill(result.ttft_s)
        self._metrics.observe_tiers([u["tier"] for u in prepared.memory_dict(result)["used"]])
        # heat counts what retrieval ranked for the query, not what the block injected (scheduler.accounting)
        event = turn_access(
            prepared.request.user_id,
            prepared.retrieved_ids,
            at=self._scheduler.clock(),
            session_id=prepared.session_id,
        )
        self._scheduler.record_access(event)
        if result.kv_fallback_reason is not None and prepared.request.block_item_id is not None:
            self._scheduler.report_unservable(prepared.request.user_id, prepared.request.block_item_id)
        if self._config.store_turns:
            future = asyncio.get_running_loop().run_in_executor(None, self._store_turn, prepared, reply)
            self._background.add(future)
            future.add_done_callback(self._background.discard)

    def _store_turn(self, prepared: PreparedChat, reply: str) -> None:
        """The turn goes to the conversation log (not the memories); the user's message is formed into
        memories in the background. Assistant replies are logged, never formed."""
        messages = [{"role": "user", "content": prepared.query}, {"role": "assistant", "content": reply}]
        user_id = prepared.request.user_id
        try:
            logged = self._store.log_turns(
                user_id,
                messages,
                session_id=prepared.session_id,
                form_roles=("user",) if self._formation is not None else (),
                admitted_generation=prepared.admitted_generation,
            )
        except Exception:
            logger.exception("logging the turn of %s failed", prepared.request.request_id)
            return
        if not logged:  # the user's memories and log were deleted after the request was admitted
            logger.info(
                "the turn of %s is not logged: its user was deleted since", prepared.request.request_id
            )
            return
        if self._formation is not None:
            self._formation.submit(user_id)

    async def drain(self) -> None:
        """Wait for turns still being stored (tests, shutdown)."""
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)

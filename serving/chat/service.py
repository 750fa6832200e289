"""The chat path: plan + search -> prompt ids -> backend stream -> OpenAI JSON or SSE; then store the turn.

Composes the scheduler (plans, access events), the plaintext store and the backend; computes nothing itself. Owns the order of
a turn: the user's message is logged (and queued for formation) before the answer's first byte, so an acknowledged turn is
durable; the reply is logged and the access event sent after it, without making the response wait for them.
Preparing a request (plan, search, layout, the check against deletes) is serving/chat/prepare.py's.
Knows nothing of auth or routing: it is handed a user id it may serve.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from scheduler import Scheduler, turn_access
from scheduler.formation import FormationWorker
from serving.backends.base import (
    Backend,
    BlockNotFound,
    GenerationResult,
    InvalidResponseFormat,
    StreamItem,
    TokenDelta,
    TokenLogprob,
)
from serving.chat import sse
from serving.chat.openai_params import check_params, response_format
from serving.chat.prepare import MAX_PREPARES, ChatPreparer, PreparedChat, memories_changed
from serving.config import DEFAULT_MODEL, ServingConfig
from serving.http.limits import check_chat
from serving.http.metrics import Metrics
from serving.http.protocol import (
    ApiError,
    ChatCompletionRequest,
    bad_request,
    completion_dict,
    logprobs_dict,
    usage_dict,
)

logger = logging.getLogger(__name__)

MAX_STOP_STRINGS = 4  # as OpenAI
# Characters per stop string: stop strings are short markers ("\n\n", "User:", "</answer>"); the cap bounds
# the text a backend holds back and its matcher's work per token (serving/engine/stops.py).
MAX_STOP_CHARS = 64
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts
# Threads for the work after a turn (logging the reply, reporting a block that could not be served): their own,
# so a slow store makes that work queue here instead of taking the default executor's threads, which prepare
# requests (plan, search); and at most this many of the store's connections.
BACKGROUND_THREADS = 2

IsDisconnected = Callable[[], Awaitable[bool]]


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
        self._preparer = ChatPreparer(config, backend, store, scheduler)
        self._background: set[asyncio.Future[Any]] = set()
        self._background_threads = ThreadPoolExecutor(
            BACKGROUND_THREADS, thread_name_prefix="kvmem-after-turn"
        )
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
        """Plan + search + layout, checked against the store (ChatPreparer.prepare); a session's first turn
        prewarms its block. Raises PromptTooLong (400), ApiError 503 memories_changed, ApiError 400
        invalid_response_format (a response format the backend cannot compile, compiled off the event loop)."""
        fmt = response_format(body)
        if fmt is not None:
            try:
                await asyncio.to_thread(self._backend.check_response_format, fmt)
            except InvalidResponseFormat as exc:
                what = f"the json_schema {fmt.name!r}" if fmt.name else f"the {fmt.type} response format"
                raise bad_request(
                    f"response_format: {what} cannot be compiled: {exc}",
                    param="response_format",
                    code="invalid_response_format",
                ) from None
        if session_id is not None and self._first_turn(user_id, session_id):
            self._scheduler.session_start(user_id)  # a new session: prewarm (next-scene prediction)
        return await self._preparer.prepare(user_id, session_id, body, started_at)

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
        self, prepared: PreparedChat, is_disconnected: IsDisconnected | None, turn: _LoggedTurn
    ) -> AsyncIterator[StreamItem]:
        """The backend stream with metrics around it; logs the reply once it completes (`turn`: the user's
        turn it answers, logged by `_started` before anything reached the client)."""
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
                        self._after_turn(prepared, "".join(text), item, turn)
                    yield item
        finally:
            self._metrics.change_in_flight(-1)

    async def _started(
        self, prepared: PreparedChat, is_disconnected: IsDisconnected | None
    ) -> tuple[PreparedChat, AsyncIterator[StreamItem]]:
        """The request the backend started (its first item awaited), and its items, that first one included. A
        block item gone since the request was prepared (BlockNotFound: a delete's cascade or an eviction dropped
        it; nothing was generated) is reported, counted as a not_found fallback, and the request prepared again
        without it: its texts go through the store's check like any, so a deleted one is never prefilled.
        Raises ApiError 503 memories_changed when that repeats MAX_PREPARES times, 499 when the client left
        before the first item.

        Once the first item is in, the user's turn is logged (committed) before this returns, so before the
        first byte of a stream or the non-streamed answer reaches the client: an acknowledged turn survives a
        crash (DESIGN invariant 9). The reply is logged after it, in the background."""
        for _ in range(MAX_PREPARES):
            turn = _LoggedTurn()
            items = self._generate(prepared, is_disconnected, turn)
            try:
                first = await anext(items)
            except BlockNotFound as exc:
                await items.aclose()
                self._metrics.observe_generation(0, 0, "not_found")
                user_id = prepared.request.user_id
                await asyncio.to_thread(self._scheduler.report_unservable, user_id, exc.item_id)
                logger.info("request %s: its block is gone; preparing it again", prepared.request.request_id)
                prepared = await self._preparer.prepare(
                    user_id,
                    prepared.session_id,
                    prepared.body,
                    prepared.started_at,
                    gone_block=exc.item_id,
                    admitted=prepared.admitted_generation,
                )
                continue
            except StopAsyncIteration:  # the client went away before anything was produced
                raise ApiError(
                    499, "client disconnected", type="invalid_request_error", code="client_disconnected"
                ) from None
            except BaseException:
                await items.aclose()
                raise
            try:
                if self._config.store_turns:
                    turn.user_turn_id = await asyncio.to_thread(self._log_user_turn, prepared)
            except Exception as exc:  # the store takes no writes (a full disk, its server away): chats are
                # still served in that degraded mode (docs/API.md), without their turn in the log
                logger.error(
                    "the turn of %s could not be logged (%s); answered without it",
                    prepared.request.request_id,
                    type(exc).__name__,
                )
            except BaseException:
                await items.aclose()
                raise
            return prepared, _prepend(first, items)
        raise memories_changed()

    async def complete(
        self, prepared: PreparedChat, model: str, is_disconnected: IsDisconnected | None
    ) -> dict:
        """A non-streaming answer as a `chat.completion` dict."""
        text: list[str] = []
        logprobs: list[TokenLogprob] = []
        result: GenerationResult | None = None
        prepared, started = await self._started(prepared, is_disconnected)
        async with aclosing(started) as items:
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
        prepared, started = await self._started(prepared, is_disconnected)
        first = await anext(started)  # already produced: no wait
        request_id = prepared.request.request_id
        event = sse.chunk_encoder(request_id, int(time.time()), model, include_usage)
        return sse.events(request_id, event, include_usage, prepared.memory_dict, first, started)

    # -- after the turn ---------------------------------------------------------------------------------------
    def _after_turn(
        self, prepared: PreparedChat, reply: str, result: GenerationResult, turn: _LoggedTurn
    ) -> None:
        """Metrics now; the reply and the access event off the response path."""
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
        self._scheduler.record_access(event)  # an enqueue
        # a block prefilled because that was cheaper than loading it ("recompute") is servable: not reported
        if (
            result.kv_fallback_reason not in (None, "recompute")
            and prepared.request.block_item_id is not None
        ):
            # off the event loop: dropping the block takes the KV store's lock and unlinks its files
            user_id, item_id = prepared.request.user_id, prepared.request.block_item_id
            self._in_background(self._scheduler.report_unservable, user_id, item_id)
        if self._config.store_turns and turn.user_turn_id is not None:
            self._in_background(self._store_reply, prepared, reply, result, turn.user_turn_id)

    def _in_background(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run `fn(*args)` on the background threads (BACKGROUND_THREADS, not the request path's default
        executor); `drain` waits for it."""
        future = asyncio.get_running_loop().run_in_executor(self._background_threads, fn, *args)
        self._background.add(future)
        future.add_done_callback(self._background.discard)

    def _log_user_turn(self, prepared: PreparedChat) -> str | None:
        """The user's message goes to the conversation log (not the memories), queued for formation; returns
        its turn id, or None when the user, or the session, was deleted after the request was admitted
        (nothing is logged). Raises what the store raises when it takes no writes."""
        user_id = prepared.request.user_id
        logged = self._store.log_turns(
            user_id,
            [{"role": "user", "content": prepared.query}],
            session_id=prepared.session_id,
            form_roles=("user",) if self._formation is not None else (),
            admitted_generation=prepared.admitted_generation,
        )
        if not logged:  # the user's (or the session's) log was deleted after the request was admitted
            logger.info(
                "the turn of %s is not logged: its user or session was deleted since",
                prepared.request.request_id,
            )
            return None
        if self._formation is not None:
            self._formation.submit(user_id)
        return logged[0].id

    def _store_reply(
        self, prepared: PreparedChat, reply: str, result: GenerationResult, user_turn_id: str
    ) -> None:
        """The assistant's reply goes to the log as the answer to `user_turn_id`, with the memories it was
        generated with (a delete of one of them removes it); never formed. Not logged if that turn or one of
        those memories was deleted meanwhile."""
        if not reply:  # nothing was generated: nothing to log
            return
        used = [u["id"] for u in prepared.memory_dict(result)["used"]]
        try:
            logged = self._store.log_turns(
                prepared.request.user_id,
                [{"role": "assistant", "content": reply}],
                session_id=prepared.session_id,
                form_roles=(),
                admitted_generation=prepared.admitted_generation,
                reply_to=user_turn_id,
                used_memory_ids=used,
            )
        except Exception:
            logger.exception("logging the reply of %s failed", prepared.request.request_id)
            return
        if not logged:
            logger.info(
                "the reply of %s is not logged: its turn, or a memory it used, was deleted since",
                prepared.request.request_id,
            )

    async def drain(self) -> None:
        """Wait for turns still being stored and fallbacks still being reported (tests, shutdown)."""
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)


@dataclass
class _LoggedTurn:
    """The user's turn of one request, once logged (None: not logged, or not yet)."""

    user_turn_id: str | None = None


async def _prepend(first: StreamItem, rest: AsyncIterator[StreamItem]) -> AsyncIterator[StreamItem]:
    """`first`, then `rest`'s items; closing it closes `rest`."""
    try:
        yield first
        async for item in rest:
            yield item
    finally:
        await rest.aclose()  # type: ignore[attr-defined]

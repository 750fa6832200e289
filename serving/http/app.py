"""The FastAPI app: OpenAI routes, memory routes, health and metrics.

`create_app(config, backend=None, store=None, scheduler=None)` wires the pieces (tests pass fakes and a
scheduler they drive). Routes only authenticate, pick the user and delegate: the chat path lives in chat.py,
storage in kvmem.text, errors become JSON in http_errors.py, the start-up work is in startup.py and the ASGI
middleware in middleware.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Header, Query, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from kvmem.errors import DependencyUnavailable
from kvmem.formation.rules import slot_of
from kvmem.text import TextStoreConfig
from scheduler import Scheduler
from scheduler.formation import FormationWorker
from scheduler.queue import require_redis
from scheduler.wiring import make_scheduler
from serving.http.auth import ANYONE, Caller, CheckHost, KeyRing, check_user
from serving.backends import create_backend
from serving.backends.base import Backend, NotReady
from serving.chat.service import ChatService
from serving.config import ServingConfig
from serving.background.formation import formation_metrics, make_formation
from serving.http.errors import MAPPED_ERRORS, error_response, handle_error, to_api_error
from serving.http.idempotency import (
    MAX_KEY_CHARS,
    Answer,
    Committed,
    EventCollector,
    IdempotencyCache,
    fingerprint,
)
from serving.http.limits import LimitBody, check_add, check_search, check_update
from serving.http.metrics import CONTENT_TYPE, UNMATCHED, Metrics, engine_lines, gauge_lines, replica_lines
from serving.http.middleware import CountRequests, ReplicaHeader
from serving.http.openapi import openapi_with_400
from serving.http.protocol import (
    AddMemoriesRequest,
    ChatCompletionRequest,
    PrewarmRequest,
    SearchMemoriesRequest,
    UpdateMemoryRequest,
    bad_request,
    plan_dict,
)
from serving.background.startup import load_and_restore
from serving.http.storage import StorageHealth, open_store

logger = logging.getLogger(__name__)

UserId = Annotated[str, Query(min_length=1, max_length=256)]
# memory writes: a repeat with the same key (same user, method and path) gets the first answer
IdempotencyKey = Annotated[
    str | None, Header(alias="Idempotency-Key", min_length=1, max_length=MAX_KEY_CHARS)
]


def _caller(request: Request, authorization: Annotated[str | None, Header()] = None) -> Caller:
    keyring: KeyRing | None = request.app.state.keyring
    return keyring.caller(authorization) if keyring is not None else ANYONE


CallerDep = Annotated[Caller, Depends(_caller)]


# -- the app ------------------------------------------------------------------------------------------------------


def create_app(
    config: ServingConfig,
    backend: Backend | None = None,
    store: Any | None = None,
    scheduler: Scheduler | None = None,
    distill_config: Any = None,
    formation: FormationWorker | None | str = "config",
) -> FastAPI:
    """Wire a server. Pieces passed in are used as they are (and closed by their owner); the rest are built
    here from `config` and closed at shutdown. Loads the API keys file now when auth is on (KeysFileError).
    With `config.distill`, background distillation runs (serving/background/distill.py) with `distill_config`
    (a scheduler.distill.job.DistillConfig; default: the scheduler's selection thresholds, training and gate
    defaults). `formation`: the memory formation worker ("config": built from `config.extractor` and started
    here; None: turns are logged, nothing is formed)."""
    keyring = KeyRing.from_file(config.keys_path) if config.auth else None
    if scheduler is None and config.scheduler_redis_url:  # replicas share it: do not start without it
        require_redis(config.scheduler_redis_url)  # DependencyUnavailable, naming it
    owned: list[Any] = []
    if backend is None:
        backend = create_backend(config)
        owned.append(backend)
    if store is None:
        # the store's own text limit admits every memory text and every chat message (a turn is stored)
        longest = max(config.limits.max_memory_text_chars, config.limits.max_message_chars)
        store = open_store(config.store_path, TextStoreConfig(max_text_chars=longest))  # StorageUnavailable
        owned.append(store)
    if scheduler is None:
        scheduler = make_scheduler(config, store, backend)
        scheduler.start()
        owned.append(scheduler)
    if formation == "config":
        formation = make_formation(config, store)
        if formation is not None:
            owned.append(formation)
    assert formation is None or isinstance(formation, FormationWorker), formation
    metrics = Metrics()
    storage_health = StorageHealth()
    write_events = EventCollector()  # the events of a write whose post-commit hook failed: what was committed
    idempotent = IdempotencyCache()
    if hasattr(store, "subscribe"):
        store.subscribe(storage_health.recovered)  # a committed write: the disk takes writes again
        store.subscribe(write_events)
    chat = ChatService(config, backend, store, scheduler, metrics, formation)
    distiller = None
    if config.distill:
        from serving.background.distill import BackgroundDistill

        distiller = BackgroundDistill(config, store, scheduler, backend, distill_config)
    started = int(time.time())
    restored = threading.Event()  # set once the stored plans were restored (scheduler.restore)
    if not scheduler.builder.finds_stored_blocks:  # a backend that cannot (fake): nothing to wait for
        restored.set()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loader = asyncio.create_task(load_and_restore(backend, store, config, scheduler, restored))
        if formation in owned:
            formation.start()  # resumes the turns the log holds pending (a rescan at start)
        if distiller is not None:
            distiller.start()  # its sweeps wait for the backend to be loaded
        try:
            yield
        finally:
            loader.cancel()
            if distiller is not None:
                distiller.close()
            await chat.drain()
            if formation in owned:
                await asyncio.to_thread(formation.stop)
            if scheduler in owned:
                scheduler.stop()
            if backend in owned:
                await backend.aclose()
            if store in owned and hasattr(store, "close"):
                store.close()

    app = FastAPI(title="kvmem", version="0.1.0", lifespan=lifespan)
    app.state.keyring = keyring
    app.state.storage_health = storage_health
    app.state.distiller = distiller
    app.state.formation = formation
    app.state.backend, app.state.store, app.state.scheduler, app.state.chat, app.state.metrics = (
        backend,
        store,
        scheduler,
        chat,
        metrics,
    )
    for exc_type in (
        *MAPPED_ERRORS,
        Exception,
    ):  # Exception: answered by the outer middleware, then re-raised
        app.add_exception_handler(exc_type, handle_error)
    app.add_middleware(
        LimitBody,
        max_body_bytes=config.limits.max_body_bytes,
        respond=lambda exc: error_response(to_api_error(exc)),
        read_timeout_s=config.read_timeout_s,
    )
    if not config.auth:  # DNS rebinding: a foreign page must not reach the keyless API through 127.0.0.1
        app.add_middleware(
            CheckHost,
            allowed_hosts=config.allowed_hosts,
            respond=lambda exc: error_response(to_api_error(exc)),
        )
    app.add_middleware(CountRequests, metrics=metrics)  # outside the others, so it counts the 413s too
    app.add_middleware(ReplicaHeader, replica=config.replica)  # outermost: every answer carries it

    def chat_user(who: Caller, body: ChatCompletionRequest, header_user: str | None) -> str:
        user_id = body.user or header_user
        if not user_id:
            if who.allowed_users is None:
                return config.default_user
            if len(who.allowed_users) == 1:
                return next(iter(who.allowed_users))
            raise bad_request("this API key may act for several users: name one in `user`", param="user")
        check_user(who, user_id, param="user")
        return user_id

    # -- OpenAI routes ----------------------------------------------------------------------------------------
    @app.get("/health")
    async def health() -> JSONResponse:
        ready = backend.is_ready() and restored.is_set()
        body = {"status": "ok" if ready else "loading", "model": backend.model_id, "backend": backend.name}
        storage_error = storage_health.error  # the last write's failure (full disk, read-only), else None
        try:
            counts = await asyncio.to_thread(store.formation_counts)
        except DependencyUnavailable as exc:  # the store's server is away: resident KV is still served
            storage_error, counts = str(exc), None
        if storage_error is not None:  # reads are served; writes fail until the disk takes them again
            body["storage_error"] = storage_error
            if ready:
                body["status"] = "degraded"
        body["formation"] = {
            "extractor": formation.extractor.name if formation is not None else None,
            "pending_turns": counts.pending if counts else None,
            "dead_turns": counts.dead
            if counts
            else None,  # dead-lettered: GET /v1/memories/formation says why
            "last_error": formation.stats.last_error if formation is not None else None,
        }
        return JSONResponse(body, status_code=200 if ready else 503)

    @app.get("/metrics")
    async def metrics_route() -> Response:
        try:
            counts = await asyncio.to_thread(store.formation_counts)
        except DependencyUnavailable:  # the store's server is away: the rest is still worth scraping
            counts = None
        text = metrics.render() + _scheduler_metrics(scheduler) + formation_metrics(formation, counts)
        text += engine_lines(backend.engine_stats()) + replica_lines(config.replica)
        return PlainTextResponse(text, media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def list_models(who: CallerDep) -> dict[str, Any]:
        model = {"id": backend.model_id, "object": "model", "created": started, "owned_by": "kvmem"}
        return {"object": "list", "data": [model]}

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(
        body: ChatCompletionRequest,
        request: Request,
        who: CallerDep,
        x_session_id: Annotated[str | None, Header(max_length=256)] = None,
        x_user_id: Annotated[str | None, Header(max_length=256)] = None,
    ) -> Response:
        started_at = time.perf_counter()
        user_id = chat_user(who, body, x_user_id)
        chat.validate(body)
        if not backend.is_ready():
            raise NotReady("still loading")
        prepared = await chat.prepare(user_id, x_session_id, body, started_at)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            lines = await chat.open_stream(prepared, body.model, include_usage, request.is_disconnected)
            return StreamingResponse(
                lines, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
            )
        return JSONResponse(await chat.complete(prepared, body.model, request.is_disconnected))

    # -- memory routes ----------------------------------------------------------------------------------------
    def tier_of(user_id: str) -> Any:
        covered = scheduler.peek(user_id).covered_ids  # a read: never queues a build; called in a thread
        return lambda memory_id: "kv" if memory_id in covered else "text"

    async def answer_write(
        key: str | None, user_id: str, request: Request, asked: Any, write: Any
    ) -> JSONResponse:
        """Run `write()` (-> Answer), or replay the first answer to this Idempotency-Key."""
        if key is None:
            answer, replayed = await write(), False
        else:
            scope_key = (user_id, request.method, request.url.path, key)
            answer, replayed = await idempotent.run(scope_key, fingerprint(asked), write)
        headers = {"Idempotent-Replayed": "true"} if replayed else None
        return JSONResponse(answer.body, status_code=answer.status, headers=headers)

    def committed(body: dict[str, Any], done: Committed) -> dict[str, Any]:
        """`body`, plus a warning when the write was committed but a post-commit hook failed."""
        if done.hook_error is None:
            return body
        warning = f"the write was committed, but a post-commit hook failed: {done.hook_error}"
        return {**body, "warnings": [warning]}

    def read_back(user_id: str, done: Committed, kind: str) -> list[Any]:
        """The memories a write committed, from its change events (its return value was lost to the hook)."""
        ids = dict.fromkeys(e.memory_id for e in done.events if e.kind == kind and e.user_id == user_id)
        return [store.get(user_id, memory_id) for memory_id in ids]

    def num_deleted(done: Committed) -> int:
        if done.hook_error is None:
            return done.value
        return len({e.memory_id for e in done.events if e.kind == "deleted"})

    @app.post("/v1/memories", status_code=201, response_model=None)
    async def add_memories(
        body: AddMemoriesRequest, request: Request, who: CallerDep, idempotency_key: IdempotencyKey = None
    ) -> JSONResponse:
        check_user(who, body.user_id)
        check_add(body, config.limits)
        if (body.text is None) == (body.messages is None):
            raise bad_request("give exactly one of `text` or `messages`", param="text")
        messages = None if body.messages is None else [m.model_dump(exclude_none=True) for m in body.messages]
        texts = [body.text] if body.text is not None else [m["content"] for m in messages or []]

        async def write() -> Answer:
            done = await asyncio.to_thread(
                write_events.committed_write,
                store.add,
                body.user_id,
                body.text,
                messages=messages,
                session_id=body.session_id,
                chat_time=body.chat_time,
                tags=body.tags,
                metadata=body.metadata,
                slots=[slot_of(t) for t in texts],  # so a fact formed later can supersede it
            )
            added = done.value
            if done.hook_error is not None:
                added = await asyncio.to_thread(read_back, body.user_id, done, "added")
            return Answer(201, committed({"memories": [m.to_dict() for m in added]}, done))

        return await answer_write(idempotency_key, body.user_id, request, body.model_dump(mode="json"), write)

    @app.post("/v1/memories/search")
    async def search_memories(body: SearchMemoriesRequest, who: CallerDep) -> dict[str, Any]:
        check_user(who, body.user_id)
        check_search(body, config.limits)
        filters = None if body.filters is None else body.filters.model_dump(exclude_none=True)
        hits = await asyncio.to_thread(
            store.search,
            body.user_id,
            body.query,
            top_k=body.top_k,
            filters=filters,
            include_superseded=body.include_superseded,
        )
        tier = await asyncio.to_thread(tier_of, body.user_id)
        return {
            "results": [{**h.memory.to_dict(), "score": h.score, "tier": tier(h.memory.id)} for h in hits]
        }

    @app.get("/v1/memories")
    async def list_memories(
        who: CallerDep,
        user_id: UserId,
        session_id: Annotated[str | None, Query(max_length=256)] = None,
        page: Annotated[int, Query(ge=1, le=1_000_000)] = 1,
        page_size: Annotated[int, Query(ge=1, le=100)] = 20,
        include_superseded: bool = False,
    ) -> dict[str, Any]:
        check_user(who, user_id)
        result = await asyncio.to_thread(
            store.list,
            user_id,
            session_id=session_id,
            page=page,
            page_size=page_size,
            include_superseded=include_superseded,
        )
        return page_body(result)

    @app.delete("/v1/memories", response_model=None)
    async def delete_memories(
        request: Request,
        who: CallerDep,
        user_id: UserId,
        session_id: Annotated[str | None, Query(max_length=256)] = None,
        idempotency_key: IdempotencyKey = None,
    ) -> JSONResponse:
        check_user(who, user_id)

        async def write() -> Answer:
            await asyncio.to_thread(scheduler.check_fence)  # replicas: 503 if they could not be told
            if session_id is None:  # and the user's conversation log
                done = await asyncio.to_thread(write_events.committed_write, store.delete_user, user_id)
                await asyncio.to_thread(scheduler.forget_user, user_id)  # also blocks no live memory id names
                if formation is not None:
                    formation.forget(user_id)
            else:
                done = await asyncio.to_thread(
                    write_events.committed_write, store.delete_session, user_id, session_id
                )
            return Answer(200, committed({"deleted": num_deleted(done)}, done))

        return await answer_write(idempotency_key, user_id, request, {"session_id": session_id}, write)

    @app.get("/v1/memories/plan")
    async def get_plan(who: CallerDep, user_id: UserId) -> dict[str, Any]:
        check_user(who, user_id)
        body = plan_dict(await asyncio.to_thread(scheduler.peek, user_id))  # never queues a build; may wait
        st = scheduler.stats()  # extension: the scheduler's tier sizes, hit rate, queue and task latency
        body["scheduler"] = {**dataclasses.asdict(st), "hit_rate": st.hit_rate}
        return body

    @app.post("/v1/memories/plan/prewarm", status_code=202)
    async def prewarm_plan(body: PrewarmRequest, who: CallerDep) -> dict[str, Any]:
        """Ask the scheduler to (re)compute the user's plan now, in the background, and make its block
        resident (what a session's first turn does). Reading a plan never builds one; a client that knows a
        user is about to chat (a login, a benchmark over a data dir seeded before the start) says so here."""
        check_user(who, body.user_id)
        scheduler.session_start(body.user_id)
        return {"queued": True}

    @app.get("/v1/memories/formation")
    async def formation_status(who: CallerDep, user_id: UserId) -> dict[str, Any]:
        """The user's turns waiting to be formed into memories, and the dead-lettered ones with the reason."""
        check_user(who, user_id)
        counts = await asyncio.to_thread(store.formation_counts, user_id)
        dead = await asyncio.to_thread(store.dead_turns, user_id)
        return {
            "user_id": user_id,
            "extractor": formation.extractor.name if formation is not None else None,
            "pending": counts.pending,
            "dead_letter": [
                {"turn_id": t.id, "reason": t.error, "attempts": t.attempts, "updated_at": t.updated_at}
                for t in dead
            ],
        }

    @app.post("/v1/memories/formation/retry")
    async def formation_retry(who: CallerDep, user_id: UserId) -> dict[str, Any]:
        """Put the user's dead-lettered turns back in formation (after fixing the extractor)."""
        check_user(who, user_id)
        requeued = await asyncio.to_thread(store.requeue_dead_turns, user_id)
        if requeued and formation is not None:
            formation.submit(user_id)
        return {"requeued": requeued}

    @app.get("/v1/memories/turns")
    async def list_turns(
        who: CallerDep,
        user_id: UserId,
        session_id: Annotated[str | None, Query(max_length=256)] = None,
        page: Annotated[int, Query(ge=1, le=1_000_000)] = 1,
        page_size: Annotated[int, Query(ge=1, le=100)] = 20,
        start: Annotated[str | None, Query(max_length=64)] = None,
        end: Annotated[str | None, Query(max_length=64)] = None,
    ) -> dict[str, Any]:
        """The user's conversation log (chat turns as said, newest first; said in [start, end] if given, ISO
        8601): not memories."""
        check_user(who, user_id)
        result = await asyncio.to_thread(
            store.list_turns,
            user_id,
            session_id=session_id,
            page=page,
            page_size=page_size,
            start=start,
            end=end,
        )
        return page_body(result)

    @app.get("/v1/memories/{memory_id}")
    async def get_memory(memory_id: str, who: CallerDep, user_id: UserId) -> dict[str, Any]:
        check_user(who, user_id)
        return (await asyncio.to_thread(store.get, user_id, memory_id)).to_dict()

    @app.patch("/v1/memories/{memory_id}", response_model=None)
    async def update_memory(
        memory_id: str,
        body: UpdateMemoryRequest,
        request: Request,
        who: CallerDep,
        idempotency_key: IdempotencyKey = None,
    ) -> JSONResponse:
        check_user(who, body.user_id)
        check_update(body, config.limits)

        async def write() -> Answer:
            await asyncio.to_thread(scheduler.check_fence)  # replicas: 503 if they could not be told
            done = await asyncio.to_thread(
                write_events.committed_write,
                store.update,
                body.user_id,
                memory_id,
                text=body.text,
                tags=body.tags,
                metadata=body.metadata,
            )
            memory = done.value
            if done.hook_error is not None:  # an update keeps the id: the new version is read back
                memory = await asyncio.to_thread(store.get, body.user_id, memory_id)
            return Answer(200, committed(memory.to_dict(), done))

        return await answer_write(idempotency_key, body.user_id, request, body.model_dump(mode="json"), write)

    @app.delete("/v1/memories/{memory_id}", response_model=None)
    async def delete_memory(
        memory_id: str,
        request: Request,
        who: CallerDep,
        user_id: UserId,
        keep_turns: bool = False,
        idempotency_key: IdempotencyKey = None,
    ) -> JSONResponse:
        """Deletes the memory and, unless keep_turns, the log turns it was formed from."""
        check_user(who, user_id)

        async def write() -> Answer:
            await asyncio.to_thread(scheduler.check_fence)  # replicas: 503 if they could not be told
            done = await asyncio.to_thread(
                write_events.committed_write, store.delete, user_id, memory_id, delete_turns=not keep_turns
            )
            return Answer(200, committed({"deleted": num_deleted(done)}, done))

        return await answer_write(idempotency_key, user_id, request, {"keep_turns": keep_turns}, write)

    metrics.set_routes(getattr(route, "path", UNMATCHED) for route in app.routes)
    app.openapi = lambda: openapi_with_400(app)  # type: ignore[method-assign]  # 400, not FastAPI's 422
    return app


def page_body(result: Any) -> dict[str, Any]:
    """A listing's JSON: its items' dicts and the page it is (a Page of memories, a TurnPage of log turns)."""
    return {
        "data": [item.to_dict() for item in result.items],
        "page": result.page,
        "page_size": result.page_size,
        "total": result.total,
    }


def _scheduler_metrics(scheduler: Scheduler) -> str:
    """Prometheus lines for the scheduler's tiers and work."""
    st = scheduler.stats()
    gauges = [
        ("kvmem_scheduler_blocks", "KV blocks published in plans.", st.num_blocks),
        ("kvmem_scheduler_block_tokens", "Tokens in published KV blocks.", st.block_tokens),
        ("kvmem_scheduler_block_bytes", "Bytes of published KV blocks.", st.block_bytes),
        ("kvmem_scheduler_plan_hit_ratio", "Plan reads that found a KV block.", st.hit_rate),
        ("kvmem_scheduler_queue_depth", "Scheduler tasks waiting.", st.queue_depth),
        ("kvmem_scheduler_tasks_total", "Scheduler tasks run.", st.tasks_done),
        ("kvmem_scheduler_task_p50_seconds", "Median scheduler task latency.", st.task_p50_s),
        ("kvmem_scheduler_builds_total", "KV blocks built by the scheduler.", st.builds),
        ("kvmem_scheduler_distill_candidates", "Memories marked for distillation.", st.distill_candidates),
        ("kvmem_scheduler_dropped_tasks", "Tasks and events the bounded queue dropped.", st.dropped_tasks),
    ]
    return gauge_lines(gauges)

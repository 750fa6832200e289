"""The FastAPI app: OpenAI routes, health and metrics; the memory routes are registered from memory_routes.py.

`create_app(config, backend=None, store=None, scheduler=None)` wires the pieces (tests pass fakes and a
scheduler they drive). Routes only authenticate, pick the user and delegate: the chat path lives in
serving/chat, storage in kvmem.text, errors become JSON in errors.py, the routes' shared parameters are
deps.py's, the start-up work is in serving/background/startup.py and the ASGI middleware in middleware.py.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import FastAPI, Header, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from kvmem.errors import DependencyUnavailable
from kvmem.text import TextStoreConfig
from scheduler import Scheduler
from scheduler.formation import FormationWorker
from scheduler.queue import require_redis
from scheduler.wiring import make_scheduler
from serving.backends import create_backend
from serving.backends.base import Backend, NotReady
from serving.background.formation import formation_health, formation_metrics, make_formation
from serving.background.startup import load_and_restore
from serving.chat.service import ChatService
from serving.config import ServingConfig
from serving.http.auth import Caller, CheckHost, KeyRing, check_user
from serving.http.deps import CallerDep, HeaderUser
from serving.http.errors import MAPPED_ERRORS, error_response, handle_error, to_api_error
from serving.http.idempotency import EventCollector, IdempotentWrites
from serving.http.limits import LimitBody
from serving.http.memory_routes import add_memory_routes
from serving.http.metrics import (
    CONTENT_TYPE,
    Metrics,
    engine_lines,
    gauge_lines,
    kv_tier_lines,
    replica_lines,
    route_template,
)
from serving.http.middleware import CountRequests, ReplicaHeader
from serving.http.openapi import openapi_with_400
from serving.http.protocol import NON_BLANK, ChatCompletionRequest, bad_request
from serving.http.storage import StorageHealth, open_store

logger = logging.getLogger(__name__)

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
        formation = make_formation(config, store, backend=backend)
        if formation is not None:
            owned.append(formation)
    assert formation is None or isinstance(formation, FormationWorker), formation
    metrics = Metrics()
    storage_health = StorageHealth()
    write_events = EventCollector()  # the events of a write whose post-commit hook failed: what was committed
    idempotent = IdempotentWrites(store)
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
        body["formation"] = formation_health(formation, counts)  # no user's words: kinds and times only
        return JSONResponse(body, status_code=200 if ready else 503)

    # text, not JSON: Prometheus's text exposition format (0.0.4), what a scraper reads; the schema says so
    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics_route() -> Response:
        try:
            counts = await asyncio.to_thread(store.formation_counts)
        except DependencyUnavailable:  # the store's server is away: the rest is still worth scraping
            counts = None
        text = metrics.render() + _scheduler_metrics(scheduler) + formation_metrics(formation, counts)
        text += engine_lines(backend.engine_stats()) + replica_lines(config.replica)
        text += kv_tier_lines(await asyncio.to_thread(backend.kv_tier_stats))  # the store's lock, sizes
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
        header_user: HeaderUser,
        x_session_id: Annotated[str | None, Header(min_length=1, max_length=256, pattern=NON_BLANK)] = None,
    ) -> Response:
        started_at = time.perf_counter()
        user_id = chat_user(who, body, header_user)
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

    add_memory_routes(app, config, store, scheduler, formation, write_events, idempotent, backend)

    metrics.set_routes(route_template(route) for route in app.routes)
    app.openapi = lambda: openapi_with_400(app)  # type: ignore[method-assign]  # 400, not FastAPI's 422
    return app


def _scheduler_metrics(scheduler: Scheduler) -> str:
    """Prometheus lines for the scheduler's tiers and work."""
    st = scheduler.stats()
    gauges = [
        ("kvmem_scheduler_blocks", "KV blocks published in plans.", st.num_blocks),
        ("kvmem_scheduler_block_tokens", "Tokens in published KV blocks.", st.block_tokens),
        ("kvmem_scheduler_block_bytes", "Bytes of published KV blocks.", st.block_bytes),
        ("kvmem_scheduler_plan_hit_ratio", "Plan reads that found a KV block.", st.hit_rate),
        ("kvmem_scheduler_queue_depth", "Scheduler tasks waiting or running.", st.queue_depth),
        ("kvmem_scheduler_tasks_total", "Scheduler tasks run.", st.tasks_done),
        ("kvmem_scheduler_task_p50_seconds", "Median scheduler task latency.", st.task_p50_s),
        ("kvmem_scheduler_builds_total", "KV blocks built by the scheduler.", st.builds),
        ("kvmem_scheduler_block_cuts_total", "KV blocks cut before a changed memory (no prefill).", st.cuts),
        ("kvmem_scheduler_distill_candidates", "Memories marked for distillation.", st.distill_candidates),
        ("kvmem_scheduler_dropped_tasks", "Tasks and events the bounded queue dropped.", st.dropped_tasks),
    ]
    return gauge_lines(gauges)

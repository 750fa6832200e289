"""The memory routes: add, search, list, get, update and delete memories, the user's plan and prewarm,
formation's status and retry, and the conversation log.

Owns each route's checks (the caller may act for the user; the request's limits) and its delegation to the
store and the scheduler, with idempotent writes and the answer of a write whose post-commit hook failed.
Knows nothing of chat, the OpenAI routes, health or metrics (app.py), nor of how the store or scheduler work.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Annotated, Any

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse
from starlette.convertors import StringConvertor, register_url_convertor

from kvmem.formation.rules import slot_of
from kvmem.text import MemoryNotFound
from kvmem.text.keyed_writes import TxView
from scheduler import Scheduler
from scheduler.formation import FormationWorker
from serving.config import ServingConfig
from serving.http.auth import check_user
from serving.http.deps import CallerDep, IdempotencyKey, SessionId, TimeParam, UserId
from serving.http.idempotency import Answer, Committed, EventCollector, IdempotentWrites, fingerprint
from serving.http.limits import check_add, check_search, check_update
from serving.http.protocol import (
    AddMemoriesRequest,
    PrewarmRequest,
    SearchMemoriesRequest,
    UpdateMemoryRequest,
    bad_request,
    plan_dict,
)

# the fixed paths one segment under /v1/memories: no memory id, so that a method they do not take is a 405
# naming theirs (GET /v1/memories/search was a look-up of a memory named "search")
FIXED_NAMES = ("search", "plan", "formation", "turns")


class MemoryIdConvertor(StringConvertor):
    """A `{memory_id:memory_id}` path segment: any but FIXED_NAMES."""

    regex = f"(?!(?:{'|'.join(FIXED_NAMES)})$)[^/]+"


register_url_convertor("memory_id", MemoryIdConvertor())


def add_memory_routes(
    app: FastAPI,
    config: ServingConfig,
    store: Any,
    scheduler: Scheduler,
    formation: FormationWorker | None,
    write_events: EventCollector,
    idempotent: IdempotentWrites,
    backend: Any = None,
) -> None:
    """Register the memory routes on `app` (after the OpenAI routes, in this order: the fixed paths under
    /v1/memories before /v1/memories/{memory_id})."""

    # -- memory routes ----------------------------------------------------------------------------------------
    def tier_of(user_id: str) -> Any:
        covered = scheduler.peek(user_id).covered_ids  # a read: never queues a build; called in a thread
        return lambda memory_id: "kv" if memory_id in covered else "text"

    async def answer_write(
        key: str | None, user_id: str, request: Request, asked: Any, write: Any, recorded: Any
    ) -> JSONResponse:
        """Run `write()` (-> Answer), or replay the first answer to this Idempotency-Key. `recorded(view)` is
        the same answer, made inside the write's transaction, where a keyed write's answer is recorded."""
        if key is None:
            answer, replayed = await write(), False
        else:
            scope = f"{request.method} {request.url.path}"
            answer, replayed = await idempotent.run(user_id, scope, key, fingerprint(asked), write, recorded)
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

    def deleted_in(user_id: str) -> Any:
        """A delete's answer from inside its transaction (a keyed write's recorded answer)."""
        return lambda view: Answer(200, {"deleted": len(view.event_ids("deleted", user_id))})

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

        def recorded(view: TxView) -> Answer:
            ids = view.event_ids("added", body.user_id)
            return Answer(201, {"memories": [view.memory(body.user_id, i).to_dict() for i in ids]})

        asked = body.model_dump(mode="json")
        return await answer_write(idempotency_key, body.user_id, request, asked, write, recorded)

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
        session_id: SessionId = None,
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
        session_id: SessionId = None,
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

        asked = {"session_id": session_id}
        return await answer_write(idempotency_key, user_id, request, asked, write, deleted_in(user_id))

    @app.get("/v1/memories/plan")
    async def get_plan(who: CallerDep, user_id: UserId) -> dict[str, Any]:
        check_user(who, user_id)
        plan = await asyncio.to_thread(scheduler.peek, user_id)  # never queues a build; may wait
        body = plan_dict(plan)
        # extension: where the block is now (pool, host, disk) and whether a request over it loads it or
        # prefills its tokens (Backend.block_residency); null without a block or a backend that says
        residency = None
        if plan.block is not None and backend is not None:
            residency = await asyncio.to_thread(backend.block_residency, plan.block.item_id)
        body["kv"] = residency
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
        """The user's turns waiting to be formed into memories (`retrying`: those a failure sent back, with its
        reason), and the dead-lettered ones with the reason. Reasons may quote the extractor's reply, so only
        the user's own caller sees them (/health has a failure's kind and time only)."""
        check_user(who, user_id)
        counts = await asyncio.to_thread(store.formation_counts, user_id)
        dead = await asyncio.to_thread(store.dead_turns, user_id)
        pending = await asyncio.to_thread(store.pending_turns, user_id, 100)
        return {
            "user_id": user_id,
            "extractor": formation.extractor.name if formation is not None else None,
            "pending": counts.pending,
            "retrying": [
                {"turn_id": t.id, "reason": t.error, "attempts": t.attempts, "updated_at": t.updated_at}
                for t in pending
                if t.error is not None
            ],
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
        session_id: SessionId = None,
        page: Annotated[int, Query(ge=1, le=1_000_000)] = 1,
        page_size: Annotated[int, Query(ge=1, le=100)] = 20,
        start: TimeParam = None,
        end: TimeParam = None,
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

    @app.get("/v1/memories/{memory_id:memory_id}")
    async def get_memory(memory_id: str, who: CallerDep, user_id: UserId) -> dict[str, Any]:
        check_user(who, user_id)
        return (await asyncio.to_thread(store.get, user_id, memory_id)).to_dict()

    @app.patch("/v1/memories/{memory_id:memory_id}", response_model=None)
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
                # a new text's own slot, as an added memory gets: the old one's would let a later fact about it
                # supersede this unrelated memory
                slot=slot_of(body.text) if body.text is not None else None,
            )
            memory = done.value
            if done.hook_error is not None:  # an update keeps the id: the new version is read back
                memory = await asyncio.to_thread(store.get, body.user_id, memory_id)
            return Answer(200, committed(memory.to_dict(), done))

        def recorded(view: TxView) -> Answer:
            return Answer(200, view.memory(body.user_id, memory_id).to_dict())

        asked = body.model_dump(mode="json")
        return await answer_write(idempotency_key, body.user_id, request, asked, write, recorded)

    @app.delete("/v1/memories/{memory_id:memory_id}", response_model=None)
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
            if num_deleted(done) == 0:  # absent, already deleted or another user's: 404, as GET and PATCH
                raise MemoryNotFound(memory_id, user_id)
            return Answer(200, committed({"deleted": num_deleted(done)}, done))

        def recorded(view: TxView) -> Answer:
            """Raises inside the transaction when it deleted nothing: a 404 is not a key's recorded answer."""
            if not view.event_ids("deleted", user_id):
                raise MemoryNotFound(memory_id, user_id)
            return deleted_in(user_id)(view)

        asked = {"keep_turns": keep_turns}
        return await answer_write(idempotency_key, user_id, request, asked, write, recorded)


def page_body(result: Any) -> dict[str, Any]:
    """A listing's JSON: its items' dicts and the page it is (a Page of memories, a TurnPage of log turns)."""
    return {
        "data": [item.to_dict() for item in result.items],
        "page": result.page,
        "page_size": result.page_size,
        "total": result.total,
    }

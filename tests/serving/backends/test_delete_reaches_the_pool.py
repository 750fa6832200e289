"""The delete cascade reaches the engine's page pool (serving/backends/transformers/backend.py `forget`): every
resident entry whose block carries a deleted memory leaves the pool before the delete returns, not only the
current plan's block; an entry being read leaves the index at once and its pages free when its reader is done;
an entry that carries none of the deleted memories stays."""

from __future__ import annotations

import asyncio
import threading

from serving.backends.base import GenerationRequest, SamplingParams, TokenDelta
from tests.serving.backends.test_transformers_backend import tokens_of, wait_released


def kept_pages(backend) -> int:
    """The pages the pool keeps when no request runs: resident items' and the prefix cache's."""
    items = {p for e in backend.pool.shared._entries.values() for p in e.pages}
    return len(items | set(backend.pool.prefix.pages()))


def chat_over(backend, user: str, texts: list[str], block) -> GenerationRequest:
    prompt = backend.layout_prompt(
        texts, [], [{"role": "user", "content": "Where do I live?"}], block.token_ids
    )
    return GenerationRequest(
        f"r-{block.item_id[:8]}",
        user,
        prompt,
        block.item_id,
        SamplingParams(max_new_tokens=8, temperature=0.0),
    )


def hold_after_first_token(backend, monkeypatch) -> threading.Event:
    """The model thread stops after the turn that handed over the first token, until the returned event is
    set: a request's reader sees its first token while the request is still mid-reply (without the hold, the
    model thread may finish an 8-token reply before the reader acts on the first)."""
    handoff, go, token_put, held = backend._loop.handoff, threading.Event(), threading.Event(), []
    put, flush = handoff.put, handoff.flush

    def put_noting_tokens(inbox, item) -> None:
        if isinstance(item, TokenDelta):
            token_put.set()
        put(inbox, item)

    def flush_then_hold() -> None:
        flush()
        if token_put.is_set() and not held:
            held.append(True)
            assert go.wait(30)

    monkeypatch.setattr(handoff, "put", put_noting_tokens)
    monkeypatch.setattr(handoff, "flush", flush_then_hold)
    return go


def test_deleting_a_memory_drops_every_resident_block_that_carries_it(tiny_backend, monkeypatch):
    backend, user = tiny_backend, "pool-delete"
    shared = backend.pool.shared
    texts = {"m": "I live in Porto.", "x": "I keep bees.", "y": "My dog is Miso.", "z": "I cook on Tuesdays."}

    def build(*ids: str):
        block = backend.build_block(user, [texts[i] for i in ids], list(ids))
        return block, [texts[i] for i in ids]

    # two builds carrying m: an earlier plan's block, then the later plan's that replaced it; and one without m
    earlier, later, other = build("m", "x"), build("m", "y"), build("x", "y")
    alone = {}
    for block, block_texts in (earlier, later, other):
        alone[block.item_id] = asyncio.run(tokens_of(backend, chat_over(backend, user, block_texts, block)))[
            0
        ]
        assert block.item_id in shared  # resident in the pool, unread once its request ended
    (earlier, earlier_texts), later, other = earlier, later[0], other[0]
    # a block of m that the store no longer holds, resident again: a request that resolved it before its
    # drop was admitted after (the store's index cannot name it to the cascade any more)
    racing, racing_texts = build("m", "z")
    item = backend._resolve_item(chat_over(backend, user, racing_texts, racing)).item
    backend.drop_block(racing.item_id)
    shared.release(shared.acquire(item).entry)
    assert racing.item_id in shared and not backend.has_block(racing.item_id)
    pages = list(shared.resident(earlier.item_id).pages)

    go = hold_after_first_token(backend, monkeypatch)

    async def delete_while_a_request_reads_the_earlier_block():
        stream = backend.stream(chat_over(backend, user, earlier_texts, earlier))
        try:
            ids = list((await anext(stream)).token_ids)  # the request holds the earlier block's pages
            forgotten = backend.forget(user, ["m"])
            assert earlier.item_id not in shared  # no new reader takes it
            assert any(backend.pool.refs(p) for p in pages)  # the reader's pages stay until it is done
        finally:
            go.set()  # the request goes on to its end
        async for out in stream:
            ids.extend(getattr(out, "token_ids", ()))
        return forgotten, ids

    forgotten, ids = asyncio.run(delete_while_a_request_reads_the_earlier_block())

    assert forgotten == sorted([earlier.item_id, later.item_id])  # the store's cascade, as before
    assert ids == alone[earlier.item_id]  # the reader finished as it would have
    assert earlier.item_id not in shared and later.item_id not in shared and racing.item_id not in shared
    assert other.item_id in shared  # carries x and y only
    wait_released(backend)
    assert not any(backend.pool.refs(p) for p in pages)  # freed once the reader was done
    assert backend.pool.prefix.pages(user) == []  # nor any prompt page of the user's (prefix_cache.py)
    assert backend.pool.used_pages == kept_pages(backend)


def test_a_block_deleted_between_a_requests_resolution_and_its_admission_leaves_the_pool_when_it_ends(
    tiny_backend, monkeypatch
):
    backend, user = tiny_backend, "pool-race"
    shared = backend.pool.shared
    texts = ["I work at the harbour.", "My cat is Tofu."]
    block = backend.build_block(user, texts, ["h", "t"])
    req = chat_over(backend, user, texts, block)
    resolve = backend._resolve_item

    def resolved_then_deleted(request):  # the delete lands after the resolution, before the admission
        found = resolve(request)
        assert backend.forget(user, ["h"]) == [block.item_id]
        assert block.item_id not in shared  # nothing in the pool yet for the cascade to drop
        return found

    monkeypatch.setattr(backend, "_resolve_item", resolved_then_deleted)
    asyncio.run(tokens_of(backend, req))  # served from the block it resolved
    assert block.item_id not in shared  # its admission put the block in the pool; its end took it out
    # nor did its prompt's pages stay in the prefix cache: it began before the delete (issue 44 item 5)
    assert backend.pool.prefix.pages(user) == []
    wait_released(backend)
    assert backend.pool.used_pages == kept_pages(backend)


def test_a_formation_request_over_a_users_turns_keeps_no_page_past_the_users_delete(tiny_backend):
    from serving.background.self_generate import FORMATION_USER, backend_generate

    backend, user = tiny_backend, "formation-delete"
    assert backend.sessions.enabled  # the prefix cache is on: a chat request's pages would be kept
    cached = set(backend.pool.prefix.pages())
    turns = " ".join(f"I moved to Porto in {2000 + i} and my sister Ana lives on Rua {i}." for i in range(6))
    messages = [
        {"role": "system", "content": f"Extract the facts of {user}."},
        {"role": "user", "content": turns},
    ]
    schema = {"type": "object", "properties": {"facts": {"type": "array", "items": {"type": "string"}}}}
    text, finish = backend_generate(backend)(messages, schema, 8)
    assert finish in ("stop", "length") and text
    wait_released(backend)
    backend.forget(user)
    # the request's pages carry the user's text: none is kept under the formation user, nor any other
    assert backend.pool.prefix.pages(FORMATION_USER) == []
    assert set(backend.pool.prefix.pages()) <= cached

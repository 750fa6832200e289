"""Shared knowledge changing while the server runs (issue 16): the running server notices a new install, lays
every prompt out under the new knowledge from then on, rebuilds its users' blocks under the new knowledge item
in the background, and never serves a block of the old knowledge meanwhile.

What a request sees: before the switch, its block (a child of the old knowledge item) from KV; once the
backend has switched (the old knowledge item and its children leave the store), the plan's block is gone, so
the new knowledge and the memories go in as text (full prefill) until the user's block is rebuilt; then the new
block from KV. A request whose plan was read before the switch but laid out after it gets the new knowledge
(the block is laid out again) and no item (the old one is gone, and an item whose tokens are not the
prompt's is refused: prefix_mismatch). The server's own stack: the
transformers backend on the tiny llama, the server's scheduler (`make_stack`), chat through HTTP; what the
backend injected is recorded at its `_resolve_item`.
"""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from benchmarks.ttft.ttft_grid import reference_tokens
from kvmem.kv import knowledge
from kvmem.kv.knowledge import KNOWLEDGE_OWNER
from serving.backends.base import GenerationRequest, SamplingParams, TokenDelta
from serving.backends.transformers.backend import TransformersBackend, TransformersBackendConfig
from tests.serving.conftest import ALICE, BOB, make_stack

OLD = ["The shop opens at 9am.", "Returns are accepted within 30 days."]
NEW = ["The shop now opens at 10am.", "Returns are accepted within 14 days.", "We ship to Spain."]
N = 6


class Recorder:
    """What the backend was asked to serve and what it injected, per request, and the tokens it produced."""

    def __init__(self, backend: TransformersBackend) -> None:
        self.served: list[dict] = []
        resolve, stream = backend._resolve_item, backend.stream

        def resolve_item(req):  # not called for a request without a block
            item, fallback = resolve(req)
            self.served[-1]["item"] = None if item is None else item.item_id
            self.served[-1]["parent"] = None if item is None else item.meta.parent_id
            self.served[-1]["fallback"] = fallback
            return item, fallback

        async def record_stream(req, is_disconnected=None):  # one request at a time in this test
            entry = {"ids": req.prompt.ids, "asked": req.block_item_id, "tokens": []}
            self.served.append({**entry, "item": None, "parent": None, "fallback": None})
            async for out in stream(req, is_disconnected):
                if isinstance(out, TokenDelta):
                    self.served[-1]["tokens"].extend(out.token_ids)
                yield out

        backend._resolve_item, backend.stream = resolve_item, record_stream


@pytest.fixture
def server(tmp_path, tiny_model_dir):
    knowledge.install(tmp_path, OLD)
    backend = TransformersBackend(
        TransformersBackendConfig(model=str(tiny_model_dir), data_dir=str(tmp_path))
    )
    backend.load()
    stack = make_stack(tmp_path, backend=backend)
    yield stack, backend, Recorder(backend)
    stack.scheduler.stop()


MESSAGES = [{"role": "user", "content": "When does the shop open?"}]


def chat(client, headers) -> dict:
    r = client.post(
        "/v1/chat/completions",
        headers=headers,
        json={
            "model": client.app.state.backend.model_id,
            "messages": MESSAGES,
            "temperature": 0,
            "max_tokens": N,
        },
    )
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def knowledge_item(backend) -> str:
    return knowledge.knowledge_item_id(backend.layout, backend.handle.fingerprint)


def test_knowledge_switch_while_serving_never_serves_stale(server):
    stack, backend, rec = server
    model = backend.handle.model
    stack.store.add("alice", texts=["Alice lives in Lisbon.", "Alice has a cat named Miso."])
    stack.store.add("bob", texts=["Bob collects stamps."])
    stack.scheduler.flush()
    old_parent = knowledge_item(backend)
    old_blocks = {u: stack.scheduler.plans.get(u).block for u in ("alice", "bob")}
    assert all(b is not None for b in old_blocks.values())
    old_items = {b.item_id for b in old_blocks.values()} | {old_parent}
    old_k = len(backend.layout.knowledge_ids)

    with TestClient(stack.app) as client:
        # before: alice's block, a child of the old knowledge item, from KV
        usage = chat(client, ALICE)
        before = rec.served[-1]
        assert (before["item"], before["parent"]) == (old_blocks["alice"].item_id, old_parent)
        assert usage["prompt_tokens_details"]["cached_tokens"] == old_blocks["alice"].num_tokens
        assert before["tokens"] == reference_tokens(model, list(before["ids"]), N, "cpu")

        # the knowledge changes; the backend notices (the scheduler has not yet): the old knowledge item and
        # its children leave the store, the plan still names bob's old block
        old_layout = backend.layout
        knowledge.install(stack.config.data_dir, NEW)
        assert backend.reload_knowledge() is True
        new_k = backend.layout.knowledge_ids
        assert new_k != before["ids"][:old_k]
        assert not any(backend.store.contains(i) for i in old_items)
        assert stack.scheduler.plans.get("bob").block.item_id == old_blocks["bob"].item_id
        # a plan read before the switch, laid out after it: the new knowledge, the block laid out again
        laid = backend.layout_prompt(old_blocks["bob"].texts, [], MESSAGES, old_blocks["bob"].token_ids)
        assert laid.ids[: len(new_k)] == new_k and laid.block_len > len(new_k)
        # the plan still names bob's old block (Scheduler.get no longer asks the store on the request path,
        # hardening item 4); the backend finds it gone and refuses it before generating (BlockNotFound, item
        # 5c): the request is prepared again without it, its memories as text, under the new knowledge
        usage = chat(client, BOB)
        refused, during = rec.served[-2:]
        assert (refused["asked"], refused["item"], refused["tokens"]) == (old_blocks["bob"].item_id, None, [])
        assert (during["asked"], during["item"]) == (None, None)
        assert during["ids"][: len(new_k)] == new_k
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0
        assert during["tokens"] == reference_tokens(model, list(during["ids"]), N, "cpu")

        # the scheduler notices: every block retracted (text, new knowledge) until rebuilt
        assert stack.scheduler.poll_layout(force=True) is True
        assert stack.scheduler.poll_layout(force=True) is False  # once
        assert all(stack.scheduler.plans.get(u).block is None for u in ("alice", "bob"))
        usage = chat(client, ALICE)
        text = rec.served[-1]
        assert (text["asked"], text["item"]) == (None, None)
        assert text["ids"][: len(new_k)] == new_k
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0
        assert text["tokens"] == reference_tokens(model, list(text["ids"]), N, "cpu")

        # the background rebuild: every dependent rebuilt as a child of the new knowledge item
        stack.scheduler.run_pending()
        new_parent = knowledge_item(backend)
        assert new_parent != old_parent and backend.store.meta(new_parent).user_id == KNOWLEDGE_OWNER
        new_blocks = {u: stack.scheduler.plans.get(u).block for u in ("alice", "bob")}
        for user, block in new_blocks.items():
            assert block is not None and block.item_id not in old_items
            assert backend.store.meta(block.item_id).parent_id == new_parent
            assert block.token_ids[: len(new_k)] == new_k
            assert set(old_blocks[user].memory_ids) <= set(block.memory_ids)
        for headers, user in ((ALICE, "alice"), (BOB, "bob")):
            usage = chat(client, headers)
            after = rec.served[-1]
            assert (after["item"], after["parent"]) == (new_blocks[user].item_id, new_parent)
            assert usage["prompt_tokens_details"]["cached_tokens"] == new_blocks[user].num_tokens
            assert after["tokens"] == reference_tokens(model, list(after["ids"]), N, "cpu")

    # a prompt laid out under the old knowledge never gets a new-knowledge block either
    old_prompt = old_layout.prompt(new_blocks["alice"].texts, [], MESSAGES)
    req = GenerationRequest("r", "alice", old_prompt, new_blocks["alice"].item_id, SamplingParams(N))
    rec.served.append({"ids": old_prompt.ids, "asked": req.block_item_id, "tokens": []})
    assert backend._resolve_item(req) == (None, "prefix_mismatch")
    rec.served.pop()

    # after the switch, no request was served an old item, and every prompt carried the new knowledge
    switched = rec.served[1:]
    assert all(s["item"] not in old_items and s["parent"] != old_parent for s in switched)
    assert all(s["ids"][: len(new_k)] == new_k for s in switched)
    # an unchanged install is a stat, not a switch
    assert backend.reload_knowledge() is False


def test_an_unreadable_install_keeps_the_current_knowledge(tiny_backend, caplog):
    root = tiny_backend.config.data_dir
    layout, generation = tiny_backend.layout, tiny_backend.knowledge_generation
    path = knowledge.knowledge_path(root)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('{"texts": "not a list"}')
    with caplog.at_level("ERROR"):
        assert tiny_backend.reload_knowledge() is False
    assert "installed knowledge unreadable" in caplog.text and "must be a list of strings" in caplog.text
    assert (tiny_backend.layout, tiny_backend.knowledge_generation) == (layout, generation)
    assert tiny_backend.reload_knowledge() is False  # the same file: not read again
    path.unlink()  # no knowledge installed, as before: no switch
    assert tiny_backend.reload_knowledge() is False
    assert (tiny_backend.layout, tiny_backend.knowledge_generation) == (layout, generation)

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from kvmem.text import HashEmbedder, InvalidMemoryInput, MemoryStore, TextStoreError
from kvmem.text.agentscope import AgentMessage, AgentScopeMemoryService, TextPart, message_text


def _msg(role, text):
    """An object shaped like agentscope_runtime's Message (type, role, content parts with .type/.text)."""
    return SimpleNamespace(type="message", role=role, content=[SimpleNamespace(type="text", text=text)])


def test_service_lifecycle_and_calls(tmp_path):
    async def scenario():
        service = AgentScopeMemoryService(path=tmp_path / "m.db", embedder=HashEmbedder())
        assert await service.health() is False
        await service.start()
        assert await service.health() is True
        await service.add_memory(
            "alice",
            [
                _msg("user", "I love hiking in the Alps"),
                {"role": "assistant", "content": "The Alps are beautiful"},
            ],
            session_id="s1",
        )
        await service.add_memory("alice", [_msg("user", "My cat is called Miso")], session_id="s2")
        await service.add_memory("bob", [_msg("user", "Bob likes hiking too")])
        hits = await service.search_memory(
            "alice", [_msg("user", "hi"), _msg("user", "I love hiking")], filters={"top_k": 1}
        )
        assert [(h.role, h.content[0].text, h.type) for h in hits] == [
            ("user", "I love hiking in the Alps", "message")
        ]
        assert hits[0].metadata["session_id"] == "s1" and hits[0].metadata["score"] > 0
        scoped = await service.search_memory("alice", [_msg("user", "hiking")], filters={"session_id": "s2"})
        assert [h.content[0].text for h in scoped] == ["My cat is called Miso"]
        assert await service.search_memory("alice", []) == []
        page = await service.list_memory("alice", filters={"page_num": 1, "page_size": 2})
        assert [m.content[0].text for m in page] == ["My cat is called Miso", "The Alps are beautiful"]
        page2 = await service.list_memory("alice", filters={"page_num": 2, "page_size": 2})
        assert [m.content[0].text for m in page2] == ["I love hiking in the Alps"]
        with pytest.raises(InvalidMemoryInput, match="unknown list_memory filter"):
            await service.list_memory("alice", filters={"page": 1})
        await service.delete_memory("alice", session_id="s1")
        assert [m.content[0].text for m in await service.list_memory("alice")] == ["My cat is called Miso"]
        await service.delete_memory("alice")
        assert await service.list_memory("alice") == []
        assert [m.content[0].text for m in await service.list_memory("bob")] == ["Bob likes hiking too"]
        await service.stop()
        assert await service.health() is False
        with pytest.raises(TextStoreError, match="not started"):
            await service.list_memory("bob")

    asyncio.run(scenario())


def test_service_over_existing_store_does_not_close_it(tmp_path):
    store = MemoryStore(tmp_path / "m.db", embedder=HashEmbedder())

    async def scenario():
        service = AgentScopeMemoryService(store)
        await service.start()
        await service.add_memory("alice", [_msg("user", "kept")])
        await service.stop()

    asyncio.run(scenario())
    assert [m.text for m in store.list("alice").items] == ["kept"]
    store.close()
    with pytest.raises(InvalidMemoryInput, match="exactly one of store or path"):
        AgentScopeMemoryService()


def test_message_text_shapes():
    assert message_text({"content": "plain"}) == "plain"
    assert message_text(_msg("user", "parts")) == "parts"
    assert message_text({"content": [{"type": "image", "url": "x"}, {"type": "text", "text": "b"}]}) == "b"
    assert AgentMessage("i", "user", [TextPart("t")]).content[0].type == "text"

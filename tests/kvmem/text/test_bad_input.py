from __future__ import annotations

import pytest

from kvmem.text import (
    HashEmbedder,
    InvalidMemoryInput,
    MemoryNotFound,
    MemoryStore,
    SearchFilters,
    TextStoreConfig,
    TextStoreError,
)
from kvmem.text.filters import MAX_METADATA_DEPTH, json_depth
from kvmem.text.store import dumps_jsonl


def _rows(store) -> int:
    return store._conn().execute("SELECT count(*) FROM memories").fetchone()[0]


def test_error_hierarchy():
    assert issubclass(InvalidMemoryInput, TextStoreError) and issubclass(InvalidMemoryInput, ValueError)
    assert issubclass(MemoryNotFound, TextStoreError)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"text": ""}, "text is empty"),
        ({"text": "   \n"}, "text is empty"),
        ({"text": 5}, "text must be a string"),
        ({}, "exactly one of text, texts or messages"),
        ({"text": "a", "texts": ["b"]}, "exactly one of text, texts or messages"),
        ({"texts": []}, "texts must be a non-empty list"),
        ({"texts": ["ok", ""]}, "texts[1] is empty"),
        ({"messages": [{"role": "user"}]}, "messages[0].content must be a string"),
        ({"messages": [{"role": "", "content": "x"}]}, "messages[0].role must be a non-empty string"),
        (
            {"messages": [{"role": "user", "content": "x", "name": "n"}]},
            "messages[0] has unknown key(s) ['name']",
        ),
        ({"text": "a", "chat_time": "yesterday"}, "chat_time is not an ISO 8601 time"),
        ({"text": "a", "tags": "single"}, "tags must be a list of strings"),
        ({"text": "a", "tags": ["ok", 3]}, "tags must hold non-empty strings"),
        ({"text": "a", "metadata": ["x"]}, "metadata must be a JSON object"),
        ({"text": "a", "metadata": {"x": object()}}, "metadata is not JSON-serializable"),
        ({"text": "a", "session_id": ""}, "session_id must be a non-empty string or None"),
    ],
)
def test_add_refuses_bad_input_and_writes_nothing(store, kwargs, message):
    with pytest.raises(InvalidMemoryInput) as info:
        store.add("alice", **kwargs)
    assert message in str(info.value)
    assert _rows(store) == 0


def test_bad_user_id(store):
    for user in ("", "  ", None, 3):
        with pytest.raises(InvalidMemoryInput, match="user_id must be a non-empty string"):
            store.add(user, "x")
        with pytest.raises(InvalidMemoryInput, match="user_id must be a non-empty string"):
            store.search(user, "x")


def test_text_over_token_limit(store_location):
    with MemoryStore(store_location, embedder=HashEmbedder(), config=TextStoreConfig(max_text_tokens=5)) as s:
        s.add("alice", "one two three four five")
        with pytest.raises(InvalidMemoryInput, match="text has 6 tokens, over the limit of 5"):
            s.add("alice", "one two three four five six")
        with pytest.raises(InvalidMemoryInput, match="query has 6 tokens, over the limit of 5"):
            s.search("alice", "one two three four five six")
        assert s.count("alice") == 1


def test_text_over_character_limit_is_refused_and_the_store_is_left_exactly_as_it_was(store_location):
    with MemoryStore(store_location, embedder=HashEmbedder(), config=TextStoreConfig(max_text_chars=10)) as s:
        (kept,) = s.add("alice", "0123456789", tags=["t"], metadata={"k": 1})
        s.update("alice", kept.id, text="abcdefghij")
        before = dumps_jsonl(s)
        refusals = [
            (lambda: s.add("alice", "x" * 11), "text has 11 characters, over the limit of 10"),
            (
                lambda: s.add("alice", texts=["ok", "y" * 12]),
                "texts[1] has 12 characters, over the limit of 10",
            ),
            (
                lambda: s.add("alice", messages=[{"role": "user", "content": "z" * 10**6}]),
                "messages[0].content has 1000000 characters, over the limit of 10",
            ),
            (
                lambda: s.update("alice", kept.id, text="w" * 11),
                "text has 11 characters, over the limit of 10",
            ),
            (lambda: s.search("alice", "q" * 11), "query has 11 characters, over the limit of 10"),
        ]
        for call, message in refusals:
            with pytest.raises(InvalidMemoryInput) as info:
                call()
            assert str(info.value) == message
        assert dumps_jsonl(s) == before
        assert [v.text for v in s.history("alice", kept.id)] == ["0123456789"]


def test_default_character_limit_is_100k(store):
    assert store.config.max_text_chars == 100_000
    store.add("alice", "a" * 100_000)
    with pytest.raises(InvalidMemoryInput, match="text has 100001 characters, over the limit of 100000"):
        store.add("alice", "a" * 100_001)
    assert store.count("alice") == 1


def test_default_limit_is_40k_tokens(store):
    assert store.config.max_text_tokens == 40_000
    with pytest.raises(InvalidMemoryInput, match="40001 tokens"):
        store.add("alice", "w " * 40_001)


@pytest.mark.parametrize(
    "filters, message",
    [
        ({"session": "s"}, "unknown filter key(s) ['session']"),
        ("session_id=s", "filters must be a dict or SearchFilters"),
        ({"tags": "x"}, "filters.tags must be a list of strings"),
        ({"metadata": {"k": [1]}}, "filters.metadata['k'] must be a string, number, bool or null"),
        ({"metadata": "k=v"}, "filters.metadata must be a dict"),
        ({"time_range": {"start": "not a time"}}, "filters.time_range.start is not an ISO 8601 time"),
        ({"time_range": {"from": "2024-01-01"}}, "unknown filters.time_range key(s) ['from']"),
        ({"time_range": {"start": "2024-02-01", "end": "2024-01-01"}}, "filters.time_range is inverted"),
        ({"session_id": 7}, "filters.session_id must be a non-empty string or None"),
    ],
)
def test_malformed_filters(store, filters, message):
    store.add("alice", "x")
    with pytest.raises(InvalidMemoryInput) as info:
        store.search("alice", "x", filters=filters)
    assert message in str(info.value)
    with pytest.raises(InvalidMemoryInput):
        store.list("alice", filters=filters)


def test_search_filters_dataclass_is_validated():
    with pytest.raises(InvalidMemoryInput, match="filters.tags must be a tuple"):
        SearchFilters(tags=["x"])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"top_k": 0}, "top_k must be an int in [1, 1000]"),
        ({"top_k": 1001}, "top_k must be an int in [1, 1000]"),
        ({"top_k": True}, "top_k must be an int"),
        ({"mode": "fuzzy"}, "mode must be one of ['hybrid', 'keyword', 'dense']"),
        ({"min_score": float("nan")}, "min_score must be a finite number"),
    ],
)
def test_bad_search_arguments(store, kwargs, message):
    with pytest.raises(InvalidMemoryInput) as info:
        store.search("alice", "x", **kwargs)
    assert message in str(info.value)
    with pytest.raises(InvalidMemoryInput, match="query is empty"):
        store.search("alice", "  ")


def test_bad_list_arguments(store):
    with pytest.raises(InvalidMemoryInput, match=r"page must be an int in \[1,"):
        store.list("alice", page=0)
    with pytest.raises(InvalidMemoryInput, match=r"page_size must be an int in \[1, 1000\]"):
        store.list("alice", page_size=1001)
    with pytest.raises(InvalidMemoryInput, match="state must be one of"):
        store.list("alice", state="deleted")
    with pytest.raises(InvalidMemoryInput, match="contradicts filters.session_id"):
        store.list("alice", session_id="a", filters={"session_id": "b"})


def test_unknown_ids(store):
    [m] = store.add("alice", "x")
    for call in (
        lambda: store.get("alice", "nope"),
        lambda: store.history("alice", "nope"),
        lambda: store.update("alice", "nope", text="y"),
        lambda: store.get("bob", m.id),
        lambda: store.update("bob", m.id, text="y"),
    ):
        with pytest.raises(MemoryNotFound) as info:
            call()
        assert "not found for user" in str(info.value)
    assert store.get("alice", m.id).version == 1
    with pytest.raises(InvalidMemoryInput, match="memory_id must be a non-empty string"):
        store.get("alice", "")


def test_bad_updates(store):
    [m] = store.add("alice", "x")
    with pytest.raises(InvalidMemoryInput, match="update needs at least one of"):
        store.update("alice", m.id)
    with pytest.raises(InvalidMemoryInput, match="text is empty"):
        store.update("alice", m.id, text="")
    with pytest.raises(InvalidMemoryInput, match="use delete to delete"):
        store.update("alice", m.id, state="deleted")
    assert store.get("alice", m.id) == m


def test_delete_session_needs_session(store):
    with pytest.raises(InvalidMemoryInput, match="session_id must be a non-empty string"):
        store.delete_session("alice", None)


def test_config_names_the_bad_field():
    with pytest.raises(ValueError, match="TextStoreConfig.max_text_tokens must be a positive int, got 0"):
        TextStoreConfig(max_text_tokens=0)
    with pytest.raises(ValueError, match="TextStoreConfig.max_text_chars must be a positive int, got -1"):
        TextStoreConfig(max_text_chars=-1)
    with pytest.raises(ValueError, match="TextStoreConfig.synchronous must be one of"):
        TextStoreConfig(synchronous="OFF")
    with pytest.raises(ValueError, match="TextStoreConfig.keyword_weight must be a number >= 0"):
        TextStoreConfig(keyword_weight=-1)


def test_closed_store_refuses(store_location):
    s = MemoryStore(store_location, embedder=HashEmbedder())
    s.close()
    with pytest.raises(TextStoreError, match="is closed"):
        s.count("alice")


def _nested(depth: int) -> dict:
    """A metadata object nested `depth` levels deep (the object itself the first): {"a": {"a": ... {}}}."""
    metadata: dict = {}
    for _ in range(depth - 1):
        metadata = {"a": metadata}
    return metadata


def test_metadata_nested_past_the_depth_limit_is_refused_and_the_store_is_left_as_it_was(store):
    (kept,) = store.add("alice", "I keep bees", metadata={"k": [1, {"x": []}]})
    assert json_depth(kept.metadata) == 4 and json_depth(_nested(300)) == 300
    before = dumps_jsonl(store)
    for call in (
        lambda: store.add("alice", "I keep wasps", metadata=_nested(300)),
        lambda: store.add("alice", "I keep wasps", metadata={"list": [_nested(32)]}),  # 34 levels
        lambda: store.update("alice", kept.id, metadata=_nested(33)),
    ):
        with pytest.raises(InvalidMemoryInput) as info:
            call()
        assert str(info.value).startswith("metadata is nested ")
        assert str(info.value).endswith(" levels deep, over the limit of 32 (max_metadata_depth)")
    assert dumps_jsonl(store) == before
    assert [m.id for m in store.list("alice").items] == [kept.id]
    assert [h.memory.id for h in store.search("alice", "bees")] == [kept.id]
    deepest = store.update("alice", kept.id, metadata=_nested(MAX_METADATA_DEPTH))  # at the limit: kept
    assert store.get("alice", kept.id).metadata == deepest.metadata == _nested(32)

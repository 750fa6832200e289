"""Time words in queries: exact ranges from the parser, and the hybrid search lifting turns of that time."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from kvmem.text import HashEmbedder, MemoryStore, TextStoreConfig
from kvmem.text.search.when import parse_query_time

WEDNESDAY = datetime(2024, 3, 13, 15, 30, tzinfo=timezone.utc)


def _clock():
    return WEDNESDAY


def _days(query):
    found = parse_query_time(query, _clock)
    return None if found is None else (found.start, found.end)


def _span(first: str, last: str) -> tuple[str, str]:
    return f"{first}T00:00:00.000000Z", f"{last}T23:59:59.999999Z"


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ("What kind of pasta did Kate make on 29 Dec 2023?", ("2023-12-29", "2023-12-29")),
        ("the party on Dec 5th, 2023", ("2023-12-05", "2023-12-05")),
        ("notes from 2024-01-05", ("2024-01-05", "2024-01-05")),
        ("What happened on January 5?", ("2024-01-05", "2024-01-05")),
        ("what did we do on 20 March", ("2023-03-20", "2023-03-20")),  # not after today: last year's
        ("my trip in May", ("2023-05-01", "2023-05-31")),
        ("what I read in March", ("2024-03-01", "2024-03-31")),
        ("in February 2024", ("2024-02-01", "2024-02-29")),
        ("on 31 Feb 2024", ("2024-02-01", "2024-02-29")),  # no such day: the month
        ("what happened in 2022", ("2022-01-01", "2022-12-31")),
        ("Which country did Elise visit in winter 2021 - 2022?", ("2021-12-01", "2022-02-28")),
        ("plans for the spring of 2024", ("2024-03-01", "2024-05-31")),
        ("in the first week of 2024", ("2024-01-01", "2024-01-07")),
        ("the last week of May 2023", ("2023-05-25", "2023-05-31")),
        ("What did we talk about yesterday?", ("2024-03-12", "2024-03-12")),
        ("what did I say today", ("2024-03-13", "2024-03-13")),
        ("what did I eat last week", ("2024-03-04", "2024-03-10")),
        ("this week so far", ("2024-03-11", "2024-03-13")),
        ("last weekend", ("2024-03-09", "2024-03-10")),
        ("last month", ("2024-02-01", "2024-02-29")),
        ("this month", ("2024-03-01", "2024-03-13")),
        ("last year", ("2023-01-01", "2023-12-31")),
        ("last Friday", ("2024-03-08", "2024-03-08")),
        ("two weeks ago", ("2024-02-25", "2024-03-02")),
        ("3 days ago", ("2024-03-10", "2024-03-10")),
        ("yesterday and 29 Dec 2023", ("2023-12-29", "2024-03-12")),  # several: the span of them all
    ],
)
def test_parse_query_time(query, expected):
    assert _days(query) == _span(*expected)


@pytest.mark.parametrize(
    "query", ["you may go", "meet at 5 pm", "my favourite food", "march forward", "Room 2024"]
)
def test_no_time_words(query):
    assert _days(query) is None


def test_time_word_spans_and_the_clock_is_read_only_when_needed():
    calls = []

    def clock():
        calls.append(1)
        return WEDNESDAY

    found = parse_query_time("pasta on 29 Dec 2023?", clock)
    assert found.spans == ((9, 20),)
    assert calls == []  # an absolute date needs no "now"
    parse_query_time("pasta yesterday", clock)
    assert calls == [1]


def test_hybrid_lifts_turns_of_the_named_time(store_location):
    config = TextStoreConfig(
        dense_weight=0.0, speaker_weight=0.0, neighbour_weight=0.0, time_weight=0.3, rerank="none"
    )
    with MemoryStore(store_location, embedder=HashEmbedder(), config=config, clock=_clock) as store:
        old, new = store.add(
            "alice",
            messages=[
                {"role": "Al", "content": "I cooked pasta", "chat_time": "2023-12-29T20:00:00Z"},
                {"role": "Al", "content": "I cooked pasta again", "chat_time": "2024-03-12T20:00:00Z"},
            ],
        )
        assert [h.memory.id for h in store.search("alice", "cooked pasta")] == [old.id, new.id]
        hits = store.search("alice", "What pasta did I cook yesterday?")
        assert [h.memory.id for h in hits] == [new.id, old.id]
        assert [round(h.score, 6) for h in hits] == [round((61 / 62 + 0.3) / 1.3, 6), round(1 / 1.3, 6)]
        # a date: the turn of that day is lifted (its rank in the words is already first)
        hits = store.search("alice", "pasta on 29 Dec 2023")
        assert [h.memory.id for h in hits] == [old.id, new.id]
        assert [round(h.score, 6) for h in hits] == [1.0, round((61 / 62) / 1.3, 6)]
        # keyword and dense modes are the plain legs: no time handling
        assert [h.memory.id for h in store.search("alice", "pasta yesterday", mode="keyword")] == [
            old.id,
            new.id,
        ]


@pytest.mark.parametrize(("slack", "lifted"), [(1, True), (0, False)])
def test_a_day_is_also_told_the_next_day(store_location, slack, lifted):
    config = TextStoreConfig(
        dense_weight=0.0,
        speaker_weight=0.0,
        neighbour_weight=0.0,
        time_weight=0.3,
        time_slack_days=slack,
        rerank="none",
    )
    with MemoryStore(store_location, embedder=HashEmbedder(), config=config, clock=_clock) as store:
        later, next_day = store.add(
            "alice",
            messages=[
                {"role": "Al", "content": "I cooked pasta", "chat_time": "2023-12-31T10:00:00Z"},
                {"role": "Al", "content": "I cooked pasta", "chat_time": "2023-12-30T09:00:00Z"},
            ],
        )
        hits = store.search("alice", "What pasta did I cook on 29 Dec 2023?")
        if lifted:  # told the morning after: inside the range's one-day slack; two days after: outside
            assert [h.memory.id for h in hits] == [next_day.id, later.id]
            assert [round(h.score, 6) for h in hits] == [round((61 / 62 + 0.3) / 1.3, 6), round(1 / 1.3, 6)]
        else:  # equal words: the earlier row first, nothing lifted
            assert [h.memory.id for h in hits] == [later.id, next_day.id]
            assert [round(h.score, 6) for h in hits] == [1.0, round(61 / 62, 6)]

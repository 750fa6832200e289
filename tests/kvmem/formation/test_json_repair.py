"""kvmem.formation.json_repair: each repair on its own, and the replies that cannot be repaired."""

from __future__ import annotations

import pytest

from kvmem.formation.json_repair import fact_items

ONE = [{"text": "I live in Berlin", "value": "berlin"}]


@pytest.mark.parametrize(
    "reply",
    [
        '{"facts": [{"text": "I live in Berlin", "value": "berlin"}]}',
        '```json\n{"facts": [{"text": "I live in Berlin", "value": "berlin"}]}\n```',
        'Here you go:\n{"facts": [{"text": "I live in Berlin", "value": "berlin"}]}\nHope it helps!',
        '{"facts": [{"text": "I live in Berlin", "value": "berlin",},],}',
        "{'facts': [{'text': 'I live in Berlin', 'value': 'berlin'}]}",
        '[{"text": "I live in Berlin", "value": "berlin"}]',
        '{"facts": [{"text": "I live in Berlin", "value": "berlin"}, {"text": "I love co',
        '```json\n{"facts": [{"text": "I live in Berlin", "value": "berlin"}, {"te',
    ],
)
def test_repairs(reply: str) -> None:
    assert fact_items(reply) == ONE


def test_apostrophes_and_python_literals() -> None:
    got = fact_items("{'facts': [{'text': 'I'm vegan', 'date': None, 'ok': True}]}")
    assert got == [{"text": "I'm vegan", "date": None, "ok": True}]


def test_an_empty_array_is_a_valid_reply_strings_are_texts_and_other_items_are_dropped() -> None:
    assert fact_items('{"facts": []}') == []
    assert fact_items('{"facts": ["x", 3, null, {"text": "a"}]}') == [{"text": "x"}, {"text": "a"}]


@pytest.mark.parametrize(
    "reply", ["I could not find any facts.", '{"answer": "none"}', '{"facts": [{"text": "I li', "{{{"]
)
def test_unrepairable(reply: str) -> None:
    with pytest.raises(ValueError):
        fact_items(reply)

"""kvmem.kv.user_facts.third_person: a memory's line tells the user's first-person statement about the user."""

from __future__ import annotations

import pytest

from kvmem.kv.user_facts import third_person


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("I live in Lisbon.", "The user lives in Lisbon."),
        ("My dog is Miso.", "The user's dog is Miso."),
        ("I am allergic to peanuts.", "The user is allergic to peanuts."),
        ("I'm a nurse.", "The user is a nurse."),
        ("I've been a welder for three years.", "The user has been a welder for three years."),
        ("I have a golden retriever called Miso.", "The user has a golden retriever called Miso."),
        ("I don't eat meat.", "The user doesn't eat meat."),
        ("I no longer eat meat.", "The user no longer eats meat."),
        ("I really love hiking.", "The user really loves hiking."),
        ("I watch anime.", "The user watches anime."),
        ("I study biology.", "The user studies biology."),
        ("I moved to Berlin in October 2026.", "The user moved to Berlin in October 2026."),
        ("We got married.", "The user got married."),
        ("My wife and I live in Braga.", "The user's wife and the user live in Braga."),
        ("My sister lives with me.", "The user's sister lives with the user."),
        ("I'll retire next year.", "The user will retire next year."),
        ("i live in berlin", "The user lives in berlin"),
        ("We're in the US.", "The user is in the US."),
        # no first-person word: unchanged but for its spaces
        ("On day 3 the user  mentioned tea.", "On day 3 the user mentioned tea."),
    ],
)
def test_a_memory_is_told_about_the_user(text: str, expected: str) -> None:
    assert third_person(text) == expected

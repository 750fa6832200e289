"""kvmem.formation.rules: exact facts (text, slot, value, kind, valid_from) for specific user turns."""

from __future__ import annotations

import pytest

from kvmem.formation.base import make_extractor
from kvmem.formation.rules import RuleExtractor, slot_of
from kvmem.formation.types import Fact, TurnInput

NOW = "2026-11-26T14:41:09.000000Z"  # a Thursday


def facts(text: str, role: str = "user", speaker: str | None = None) -> list[Fact]:
    return RuleExtractor().extract([TurnInput("t1", role, text, NOW, "s1", speaker)])


def triples(text: str) -> list[tuple[str, str | None, str | None]]:
    return [(f.text, f.slot, f.value) for f in facts(text)]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("I live in Berlin.", [("I live in Berlin", "user|home_city", "berlin")]),
        ("i live in berlin", [("I live in berlin", "user|home_city", "berlin")]),
        (
            "We relocated to the Netherlands.",
            [("We relocated to the Netherlands", "user|home_city", "netherlands")],
        ),
        ("I'm from Porto.", [("I'm from Porto", "user|origin", "porto")]),
        ("I work as a nurse.", [("I work as a nurse", "user|job", "nurse")]),
        ("I'm a software engineer.", [("I'm a software engineer", "user|job", "software engineer")]),
        ("I'm a big fan of jazz.", [("I'm a big fan of jazz", "user|likes:jazz", "yes")]),
        ("I work at Siemens.", [("I work at Siemens", "user|employer", "siemens")]),
        ("I got a job at Spotify!", [("I got a job at Spotify", "user|employer", "spotify")]),
        ("I quit my job.", [("I quit my job", "user|job", "none")]),
        ("I'm single.", [("I'm single", "user|relationship", "single")]),
        ("We got married!", [("We got married", "user|relationship", "married")]),
        ("I have a dog named Max.", [("I have a dog named Max", "user|dog.name", "max")]),
        ("My kitten is called Luna.", [("My kitten is called Luna", "user|cat.name", "luna")]),
        ("I also have a cat called Luna.", [("I also have a cat called Luna", None, None)]),
        (
            "Actually, my dog is called Rex, not Max.",
            [("My dog is called Rex, not Max", "user|dog.name", "rex")],
        ),
        (
            "My favourite colour is now green.",
            [("My favourite colour is now green", "user|favourite:colour", "green")],
        ),
        ("Green is my favorite color.", [("Green is my favorite color", "user|favourite:colour", "green")]),
        ("I love coffee.", [("I love coffee", "user|likes:coffee", "yes")]),
        ("I don't drink coffee anymore.", [("I don't drink coffee anymore", "user|likes:coffee", "no")]),
        ("I love coffee and tea.", [("I love coffee and tea", None, None)]),
        ("I don't run anymore.", [("I don't run anymore", "user|likes:running", "no")]),
        ("I like to cook.", [("I like to cook", "user|likes:cooking", "yes")]),
        ("I'm vegetarian.", [("I'm vegetarian", "user|diet", "vegetarian")]),
        ("I'm not vegan anymore.", [("I'm not vegan anymore", "user|diet", "not:vegan")]),
        ("I started eating meat again.", [("I started eating meat again", "user|diet", "omnivore")]),
        ("I'm allergic to peanuts.", [("I'm allergic to peanuts", "user|allergy:peanuts", "yes")]),
        ("I'm 34.", [("I'm 34", "user|age", "34")]),
        ("I just turned 40!", [("I just turned 40", "user|age", "40")]),
        (
            "My email is Ana.Silva@Example.com.",
            [("My email is Ana.Silva@Example.com", "user|email", "ana.silva@example.com")],
        ),
        (
            "My number is +351 912 345 678.",
            [("My number is +351 912 345 678", "user|phone", "+351912345678")],
        ),
        ("My name is Ana.", [("My name is Ana", "user|name", "ana")]),
        ("Call me Sam.", [("Call me Sam", "user|name", "sam")]),
        ("I'm Portuguese.", [("I'm Portuguese", None, None)]),
        ("My sister lives in Rome.", [("My sister lives in Rome", "sister|home_city", "rome")]),
        ("My mum is a teacher.", [("My mum is a teacher", "mother|job", "teacher")]),
        ("My friend lives in Paris.", [("My friend lives in Paris", None, None)]),
        (
            "My friend Tom lives in Paris.",
            [("My friend Tom lives in Paris", "friend:tom|home_city", "paris")],
        ),
        ("I used to live in Madrid.", [("I used to live in Madrid", None, None)]),
        ("We're going to Japan in May.", [("We're going to Japan in May", None, None)]),
        ("I started learning the violin.", [("I started learning the violin", None, None)]),
    ],
)
def test_statement_slots(text: str, expected: list[tuple[str, str | None, str | None]]) -> None:
    assert triples(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # chat drops the subject; the text stays as said, the slot reads it with "I" put back
        ("Moved to Oslo, still unpacking.", [("Moved to Oslo, still unpacking", "user|home_city", "oslo")]),
        ("Been living in Oslo since 2020.", [("Been living in Oslo since 2020", "user|home_city", "oslo")]),
        ("Can't stand jazz.", [("Can't stand jazz", "user|likes:jazz", "no")]),
        ("Not really into jazz anymore.", [("Not really into jazz anymore", "user|likes:jazz", "no")]),
        ("Married with two kids.", [("Married with two kids", "user|relationship", "married")]),
        # intensifiers and adverbs between subject and verb are read past
        ("I'm so over jazz.", [("I'm so over jazz", "user|likes:jazz", "no")]),
        (
            "I've kind of gone off coffee lately.",
            [("I've kind of gone off coffee lately", "user|likes:coffee", "no")],
        ),
        (
            "We finally made the move to Porto!",
            [("We finally made the move to Porto", "user|home_city", "porto")],
        ),
        ("Our flat is in Leeds.", [("Our flat is in Leeds", "user|home_city", "leeds")]),
        ("Berlin is home now.", [("Berlin is home now", "user|home_city", "berlin")]),
        ("My wife and I moved to Rome.", [("My wife and I moved to Rome", "user|home_city", "rome")]),
        ("I follow a vegan diet.", [("I follow a vegan diet", "user|diet", "vegan")]),
        ("Sushi is my guilty pleasure.", [("Sushi is my guilty pleasure", "user|likes:sushi", "yes")]),
        (
            "My fave food these days is ramen.",
            [("My fave food these days is ramen", "user|favourite:food", "ramen")],
        ),
        ("We renamed our cat Mochi.", [("We renamed our cat Mochi", "user|cat.name", "mochi")]),
        ("My dog Max is three.", [("My dog Max is three", "user|dog.name", "max")]),
        ("Sadly my dog Max died.", [("Sadly my dog Max died", "user|dog.name", "none")]),
        # apostrophes left out, as people type in chat: read as the contraction, and kept in that spelling
        ("I dont like spicy food.", [("I don't like spicy food", "user|likes:spicy_food", "no")]),
        ("i cant stand jazz", [("I can't stand jazz", "user|likes:jazz", "no")]),
        ("Im not a fan of cats", [("I'm not a fan of cats", "user|likes:cats", "no")]),
        ("Ive moved to Porto.", [("I've moved to Porto", "user|home_city", "porto")]),
    ],
)
def test_chat_phrasings(text: str, expected: list[tuple[str, str | None, str | None]]) -> None:
    assert triples(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "Just kidding!",
        "Absolutely, the weather matters a lot.",
        "Don't worry about it.",
        "Loved it!",
        "Hi!",
        "Good morning!",
        "Thanks so much!",
        "ok",
        "lol",
        "sounds good",
        "I see.",
        "Haha, I love it!",
        "Can you tell me a joke?",
        "Tell me a joke.",
        "Could you recommend a book?",
        "I need a recipe for dinner.",
        "What's the weather like in Berlin?",
        "Do you think I should move to Berlin?",
        "If I were rich, I'd buy a boat.",
        "Maybe I should learn Spanish.",
        "I might get a dog someday.",
        "I wish I lived in Rome.",
        "You're really helpful.",
        "I like your answers.",
        "I love talking to you.",
        "Okay I'm off to bed now, speak tomorrow!",  # leaving the conversation, or stepping away
        "Gotta dash, the bus is here.",
        "Sorry, I had to step away for a bit.",
        "Huh, I never knew that about octopuses.",  # a reaction to what was said
        "Had I stayed at the bank I'd be a manager by now.",  # an inverted conditional
    ],
)
def test_non_memory_yields_nothing(text: str) -> None:
    assert facts(text) == []


def test_assistant_and_system_turns_yield_nothing() -> None:
    assert facts("I live in the cloud and I love helping.", role="assistant") == []
    assert facts("I am a helpful assistant.", role="system") == []


def test_a_speakers_turn_is_kept_as_said() -> None:
    got = facts("I finally went bouldering at the new gym.", speaker="Ben")
    assert [f.text for f in got] == ["I finally went bouldering at the new gym"]  # no "Ben: " prefix


def test_clauses_split_only_between_whole_statements() -> None:
    assert triples("Hi! I live in Berlin and I work as a nurse.") == [
        ("I live in Berlin", "user|home_city", "berlin"),
        ("I work as a nurse", "user|job", "nurse"),
    ]
    assert triples("I love coffee but I hate tea.") == [
        ("I love coffee", "user|likes:coffee", "yes"),
        ("I hate tea", "user|likes:tea", "no"),
    ]
    assert [f.text for f in facts("My girlfriend and I broke up.")] == ["My girlfriend and I broke up"]
    assert [f.text for f in facts("I have a dog and a cat.")] == ["I have a dog and a cat"]
    # the statement before the question is kept
    assert [f.text for f in facts("I just adopted a cat, any name ideas?")] == ["I just adopted a cat"]
    # a laugh mid-message ends a sentence ("lol" as a verb does not)
    assert [f.text for f in facts("I forgot lol but i work in a clinic")] == [
        "I forgot",
        "I work in a clinic",
    ]
    assert [f.text for f in facts("I always lol at his jokes")] == ["I always lol at his jokes"]
    # a statement of the user's joined to a whole clause about something else: the statement is kept alone
    assert [f.text for f in facts("The twins started nursery in May so I've gone back to the salon.")] == [
        "I've gone back to the salon"
    ]
    assert [f.text for f in facts("The van broke down on the M5 and we've had to stay in Taunton.")] == [
        "We've had to stay in Taunton"
    ]
    # told in the present it stays with the clause before it, which may hold its date
    assert facts("The lease on the flat runs out next month so we're moving to Leeds.") == []
    # a subject shared with the user is no clause of its own
    assert [f.text for f in facts("Priya and I moved to Leeds.")] == ["Priya and I moved to Leeds"]
    assert [f.text for f in facts("I was soaked so I took a taxi.")] == ["I was soaked", "I took a taxi"]
    # a taste told with the thing first is the user's
    assert [f.text for f in facts("Jazz bores me to tears.")] == ["Jazz bores me to tears"]
    assert [f.text for f in facts("Karaoke is my idea of hell.")] == ["Karaoke is my idea of hell"]
    assert [f.text for f in facts("Cricket has never interested me.")] == ["Cricket has never interested me"]
    assert [f.text for f in facts("Golf isn't really my cup of tea.")] == ["Golf isn't really my cup of tea"]
    # a dropped subject after another person's clause is theirs, not the user's
    assert [f.text for f in facts("My parents have sold the farm and retired to Ayr.")] == [
        "My parents have sold the farm and retired to Ayr"
    ]


@pytest.mark.parametrize(
    ("text", "kept"),
    [
        ("Since June I've been living in Tromso.", "Since June I've been living in Tromso"),  # no year
        ("As of last month I'm not teaching anymore.", "As of October 2026 I'm not teaching anymore"),
        ("As of this week I'm retired.", "As of the week of 2026-11-23 I'm retired"),
        ("Oddly I love olives now.", "Oddly I love olives now"),  # a leading adverb of attitude
        ("Usually I just have toast and eggs.", "Usually I just have toast and eggs"),  # of frequency
        (
            "As of Monday I'm the head chef at Rosa's.",
            "As of Monday I'm the head chef at Rosa's",
        ),  # a weekday
        ("Since Tuesday I work nights at the depot.", "Since Tuesday I work nights at the depot"),
        ("After ten years in Porto, I moved to Faro.", "After ten years in Porto, I moved to Faro"),
    ],
)
def test_a_statement_after_a_leading_adverbial_is_kept(text: str, kept: str) -> None:
    assert [f.text for f in facts(text)] == [kept]


@pytest.mark.parametrize(
    "text",
    [
        "I'm off to Lima in May.",
        "I have to go to physio twice a week.",
        "I had to run a half marathon.",
        "I've got to go to dialysis three times a week now.",
        "I never knew that I was lactose intolerant until my GP told me.",
    ],
)
def test_a_statement_worded_like_leaving_the_chat_is_kept(text: str) -> None:
    assert [f.text for f in facts(text)] == [text.rstrip(".")]


def test_dates_are_resolved_and_give_valid_from() -> None:
    (moved,) = facts("I moved to Lisbon last month.")
    assert (moved.text, moved.slot, moved.value) == (
        "I moved to Lisbon in October 2026",
        "user|home_city",
        "lisbon",
    )
    assert moved.valid_from == "2026-10-01T00:00:00.000000Z"
    (dentist,) = facts("Yesterday I went to the dentist.")
    assert (dentist.text, dentist.kind, dentist.valid_from) == (
        "On 2026-11-25 I went to the dentist",
        "event",
        "2026-11-25T00:00:00.000000Z",
    )
    (plan,) = facts("I'm flying to Rome tomorrow.")  # a plan is known from when it is said
    assert (plan.text, plan.kind, plan.valid_from) == ("I'm flying to Rome on 2026-11-27", "plan", NOW)
    (today,) = facts("I moved to Porto today.")  # today: the turn's time, not midnight
    assert today.valid_from == NOW


def test_kinds_and_provenance() -> None:
    got = RuleExtractor().extract(
        [
            TurnInput("a", "user", "I love jazz. My sister is a nurse.", NOW),
            TurnInput("b", "assistant", "Nice!", NOW),
            TurnInput("c", "user", "I'm going to repaint my bedroom. I live in Oslo. I live in Oslo!", NOW),
        ]
    )
    assert [(f.text, f.kind, f.turn_ids) for f in got] == [
        ("I love jazz", "preference", ("a",)),
        ("My sister is a nurse", "relation", ("a",)),
        ("I'm going to repaint my bedroom", "plan", ("c",)),
        ("I live in Oslo", "fact", ("c",)),  # repeated within one turn: one fact
    ]


def test_slot_of_a_memory_added_directly() -> None:
    assert slot_of("My dog is called Rex.") == ("user|dog.name", "rex")
    assert slot_of("Remember: I moved to Berlin in 2024.") == ("user|home_city", "berlin")
    assert slot_of("The weather was nice.") is None


def test_registry() -> None:
    assert make_extractor("rules").name == "rules"
    with pytest.raises(ValueError, match=r"extractor: unknown name 'llama'; supported: rules, openai"):
        make_extractor("llama")

"""Normalizers for slot values and subjects: the canonical lowercase form two statements of the same value
share ("The Netherlands" and "the netherlands" -> "netherlands"), or None where the words are not a value of
that kind ("a small flat" is no city).

Pure string functions over general English; knows nothing of patterns, turns or facts.
"""

from __future__ import annotations

import re

from kvmem.formation.lexicon import NEEDS_NAME, NOT_NAMES, OCCUPATIONS, RELATIVES

__all__ = ["NEEDS_NAME"]

_DETERMINERS = frozenset("a an the my our his her their your this that these those some any all".split())
_PRONOUNS = frozenset(
    "it that this them those these him her he she they me you us one everything something nothing anything"
    " stuff things".split()
)
_NOT_PLACES = frozenset(
    "a an my our his her their this that some another one here there home somewhere town".split()
)
# "the ..." places that are names although the next word is lowercase in chat
_THE_PLACES = frozenset(
    "netherlands uk us usa states philippines bahamas gambia uae czech republic bay area caribbean".split()
)
_NOT_NAME_WORDS = frozenset(
    "a an the my our his her their it this that not now no yes so too very just really and or but"
    " on in at to from for".split()
)
# "I don't <verb> anymore" where the verb is not an activity one could like
NOT_ACTIVITIES = frozenset(
    "do care know think mind understand remember need want have live work believe feel see talk".split()
)
# a second pet or thing is added, not a replacement: "another dog", "a second cat", "also have a cat" (read up
# to the name: "my dog Max is three" renames nothing), or "... too" at the end
ADDS_ANOTHER = re.compile(r"\b(?:another|second|third|other|also|too|as well|both|two|three|more)\b", re.I)
ALSO_AT_END = re.compile(r"\b(?:too|as well)$", re.I)
# "I love coffee and tea": the object is one of several
# a second object after the first ("coffee, tea and cake", "coffee and tea"); not a comment after a comma ("I love
# sunbathing, the browner the better", "I can't stand yoga, it's so boring", "gone off it, couldn't finish it")
MORE_OBJECTS = re.compile(
    r"\s*(?:,\s*(?!(?:the|it|it's|its|they|they're|that|that's|this|which|so|but|especially|though|mostly|I|I'm|"
    r"I've|we|we're|always|every|most|nothing|no|not|mainly|esp)\b)\w[\w' -]{0,30}?(?:,|\s+(?:and|or)\b)|&|"
    r"(?:and|or|as well as|plus)\b)",
    re.I,
)
_SPACES = re.compile(r"\s+")
_PUNCT = re.compile(r"[\"'`]+$|^[\"'`]+")


def plain(raw: str) -> str | None:
    """Lowercase, single spaces, no surrounding quotes; None when empty."""
    text = _PUNCT.sub("", _SPACES.sub(" ", raw.strip())).lower().strip(" -")
    return text or None


# a home named after its place ("the Cardiff flat", "our Leeds house"): the place
_HOME_NOUNS = frozenset("flat house place apartment home cottage bungalow terrace semi condo".split())


def place(raw: str) -> str | None:
    """A named place ("Berlin", "New York", "the Netherlands") as "berlin", "new york", "netherlands"."""
    words = raw.split()
    if not words or len(words) > 4 or words[0].lower() in _NOT_PLACES:
        return None
    if words[0].lower() == "the":
        rest = words[1:]
        if not rest or not (rest[0][0].isupper() or rest[0].lower() in _THE_PLACES):
            return None
        words = rest
    if len(words) > 1 and words[-1].lower() in _HOME_NOUNS:  # "the Cardiff flat": Cardiff
        words = words[:-1]
    return plain(" ".join(words))


def name(raw: str | None) -> str | None:
    """A person's or pet's name, one or two words, lowercased."""
    if not raw:
        return None
    words = raw.split()
    if not words or len(words) > 2 or words[0].lower() in _NOT_NAME_WORDS:
        return None
    return plain(" ".join(words))


def person_name(raw: str) -> str | None:
    """A name said as "I'm Ana": not a nationality, faith or state ("I'm Portuguese", "I'm Fine")."""
    return None if raw.lower() in NOT_NAMES else name(raw)


def age(raw: str | None) -> str | None:
    return raw if raw and 0 < int(raw) <= 120 else None


def phone(raw: str) -> str | None:
    digits = re.sub(r"\D", "", raw)
    if not 6 <= len(digits) <= 15:
        return None
    return ("+" if raw.strip().startswith("+") else "") + digits


def _strip_determiner(words: list[str]) -> list[str]:
    while words and words[0].lower() in _DETERMINERS:
        words = words[1:]
    return words


def job_any(raw: str) -> str | None:
    """A job as said after "work as": up to four words, determiners dropped."""
    words = _strip_determiner(raw.split())
    return plain(" ".join(words)) if 0 < len(words) <= 4 else None


def job_known(raw: str) -> str | None:
    """A job after "I'm a": only when its head noun is an occupation ("senior nurse", not "big fan")."""
    words = _strip_determiner(raw.split())
    if not 0 < len(words) <= 4:
        return None
    head = words[-1].lower()
    pair = " ".join(words[-2:]).lower()
    if (
        head not in OCCUPATIONS
        and not head.endswith(("ologist", "ographer", "ician"))
        and pair not in _TWO_WORD_JOBS
    ):
        return None
    if any(w.lower() in _NOT_JOB_MODIFIERS for w in words[:-1]):
        return None  # "a glorified porter", "a keen gardener", "a Sunday league referee"
    return plain(" ".join(words))


# words before an occupation that make it a way of being, a pastime or a joke, not the job
_NOT_JOB_MODIFIERS = frozenset(
    """glorified mean wannabe aspiring amateur hobby keen good bad terrible great natural born secret fake honorary
    unpaid self-taught budding frustrated failed backseat armchair weekend league volunteer voluntary pretend
    free-range resident house home family special reluctant personal total lot bit""".split()
)
# jobs whose head noun alone is no occupation ("I'm a real servant to my cats")
_TWO_WORD_JOBS = frozenset(
    {"civil servant", "dinner lady", "lollipop lady", "delivery rider", "public servant"}
)


# Heads of "I've been a X for N years" that are not a job: a fan, a member, a diet, a parent.
_NOT_JOB_HEADS = frozenset(
    """
    fan member customer client resident patient smoker drinker user subscriber reader listener viewer
    follower supporter believer parent mum mom mother dad father grandparent widow widower couple wife husband
    partner vegan vegetarian pescatarian carnivore omnivore person people type bit lot while runner cyclist
    swimmer citizen owner homeowner tenant regular addict sufferer survivor
    """.split()
)


def job_held(raw: str) -> str | None:
    """The job in "I've been a X for N years" / "since 2019": the construction says it is held, so any head
    noun but those that are not jobs (a fan, a member, a vegan, a parent)."""
    words = _strip_determiner(raw.split())
    head = words[: words.index("of")] if "of" in words else words  # "member of the choir": member
    if not 0 < len(words) <= 4 or not head or head[-1].lower() in _NOT_JOB_HEADS:
        return None
    return plain(" ".join(words))


# "I work in retail": a field of work; not a place or a building ("I work in town", "in an office")
_NOT_FIELDS = frozenset(
    "a an the my our their his her this that town the city here there shifts teams office offices home "
    "london paris berlin labour labor hospital shock hiding detail overdrive debt overdraft remission surgery it "
    "lockdown isolation quarantine space orbit".split()
)


def work_field(raw: str) -> str | None:
    """The field in "I work in retail" / "in tech" / "in customer support": one to three lowercase words."""
    words = raw.split()
    if not 0 < len(words) <= 3 or words[0] in _NOT_FIELDS or not all(w.islower() for w in words):
        return None
    return plain(" ".join(words))


def org(raw: str) -> str | None:
    """An employer: "Google", "a bank" -> "bank"; "myself" -> "self-employed"."""
    words = raw.split()
    if words and words[0].lower() in {"myself", "ourselves"}:
        return "self-employed"
    words = _strip_determiner(words)
    if not 0 < len(words) <= 5 or words[0].lower() in _PRONOUNS or words[0].lower() == "home":
        return None
    return plain(" ".join(words))


_THING_TAIL = frozenset("these those days now nowadays lately currently at the moment right".split())


def thing(raw: str) -> str | None:
    """The kind of favourite: "colour"/"color" -> "colour", spaces -> "_" ("tv_show")."""
    words = raw.lower().split()
    while words and words[-1] in _THING_TAIL:
        words = words[:-1]
    if not 0 < len(words) <= 3:
        return None
    text = "_".join(words).replace("color", "colour")
    return text


_CONSUMPTION_GERUND = re.compile(
    r"^(?:drinking|eating|playing|watching|listening to|reading|smoking|having|doing|using|wearing)\s+(?=\S)",
    re.I,
)


_QUANTITY = re.compile(r"^(?:lot of|lots of|loads of|plenty of|tons of|bit of|little|few)\s+(?=\S)", re.I)


# gerunds that name no activity without what follows them: "I stopped going" and "I like going for walks"
# share no taste (REALTALK: the first retired the second as "user|likes:going")
_BARE_GERUNDS = frozenset(
    "going doing getting having being making taking coming trying putting keeping".split()
)


def thing_object(raw: str) -> str | None:
    """The object of a like or dislike, as the key of "user|likes:<object>": determiners dropped, "to
    cook" -> "cooking", "drinking coffee" -> "coffee"; None for a pronoun, a light verb's gerund alone
    ("going"; "making pasta" keeps its object) or more than four words."""
    words = _strip_determiner(raw.split())
    if not words:
        return None
    if words[0].lower() == "to" and len(words) > 1:
        words = [gerund(words[1].lower()), *words[2:]]
    text = _QUANTITY.sub("", _CONSUMPTION_GERUND.sub("", " ".join(words)))
    words = _strip_determiner(text.split())
    if not 0 < len(words) <= 4 or words[0].lower() in _PRONOUNS or " ".join(words).lower() in _BARE_GERUNDS:
        return None
    return plain(" ".join(words).replace(" ", "_"))


_VOWELS = "aeiou"


def gerund(verb: str) -> str:
    """ "hike" -> "hiking", "run" -> "running", "ski" -> "skiing", "lie" -> "lying", "cook" -> "cooking"."""
    if verb.endswith("ing"):
        return verb
    if verb.endswith("ie"):
        return verb[:-2] + "ying"
    if verb.endswith("e") and not verb.endswith(("ee", "ye", "oe")):
        return verb[:-1] + "ing"
    if (
        len(verb) >= 3
        and verb[-1] not in _VOWELS + "wxy"
        and verb[-2] in _VOWELS
        and verb[-3] not in _VOWELS
        and sum(c in _VOWELS for c in verb) == 1
    ):
        return verb + verb[-1] + "ing"
    return verb + "ing"


def relative_subject(rel: str, relname: str | None) -> str | None:
    """The subject a relative's slots use: "sister"; a friend needs a name: "friend:tom"; None without."""
    subject = RELATIVES[rel.lower()]
    if subject in NEEDS_NAME:
        return f"{subject}:{relname.lower()}" if relname else None
    return subject

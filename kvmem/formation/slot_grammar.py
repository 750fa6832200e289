"""The pieces the slot table (`slots.RULES`) is written with: regex fragments for subjects, auxiliaries,
adverbs and values that end at a stop word, and builders that turn a match into (slot, value).

Knows nothing of which statements set which slot (that is the table) nor of turns or consolidation.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from kvmem.formation import values as v
from kvmem.formation.lexicon import (
    DIETS,
    FIELDS,
    JOB_GERUNDS,
    JOKED_PARTNERS,
    RELATIONSHIP,
    RELATIVES,
    SPECIES,
    WORKPLACES,
)

Build = Callable[[re.Match[str]], "tuple[str, str] | None"]


@dataclass(frozen=True)
class SlotRule:
    pattern: re.Pattern[str]
    build: Build  # (slot, value), or None to let the next rule try
    kind: str


def alt(words: object) -> str:
    return "|".join(sorted((re.escape(str(w)) for w in words), key=len, reverse=True))


# ---- pattern pieces --------------------------------------------------------------------------------------

STOP = (
    r"and|but|or|because|cause|since|as|so|now|anymore|any more|these days|right now|at the moment|with|for|"
    r"in|on|at|from|near|after|before|when|while|who|whom|which|where|that|not|too|again|already|still|"
    r"though|although|ever|yet|lately|recently|currently|nowadays|instead|either|then|this|last|next|every|"
    r"each|most|to|than|over|until|till|by|ago|haha|lol|full-time|part-time|anyway|honestly|though|completely|"
    r"entirely|altogether|for good|cold turkey|at all|forever|once and for all"
)
END = rf"(?=\s*$|\s*[,.;:!?()\"]|\s+(?:{STOP})\b)"


def val(name: str) -> str:
    """A value up to the clause end, punctuation or a stop word ("Berlin" in "in Berlin with my wife")."""
    return rf"(?P<{name}>[^,.;:!?()\"]+?){END}"


NAME = rf"(?P<name>[A-Za-z][\w'-]*(?: (?-i:[A-Z])[\w'-]*)?){END}"
# the user, alone or with someone ("my wife and I", "Noah and I"; a name, not a thing the user jokes of as a partner:
# lexicon.JOKED_PARTNERS)
SUBJ = (
    rf"(?:I|we|me and my \w+|(?:my|our|the) \w+ and I|(?!(?:{JOKED_PARTNERS}) )(?-i:[A-Z])[a-z]+ and (?:I|me)|"
    rf"me and (?!(?:{JOKED_PARTNERS})\b)(?-i:[A-Z])[a-z]+)"
)
BE = r"(?:'m| am|'re| are)"

HAVE = r"(?:'ve| have)?"
ADV = (
    r"(?:(?:now|currently|still|just|recently|finally|officially|actually|already|also|happily|proudly|"
    r"basically|technically|really|absolutely|totally|kind of|kinda|truly|do|even|literally|definitely|"
    r"honestly|genuinely|mostly|full-time|part-time|permanently|originally|newly|so|pretty|quite|completely|"
    r"sort of|properly)\s+)*"
)
ADJ = r"(?:(?:older|younger|little|big|baby|twin|eldest|oldest|youngest|new|old|dear|sweet|cute)\s+)?"
SPECIES_RE = alt(SPECIES)
RELATIVES_RE = alt(RELATIVES)
DIETS_RE = alt(DIETS)
RELATIONSHIP_RE = alt(RELATIONSHIP)
POSITIVE = r"love|like|enjoy|adore|prefer|dig|am into|'m into|are into|'re into"
NEGATIVE = (
    r"hate|dislike|detest|loathe|can't stand|cannot stand|can't bear|don't like|do not like|don't enjoy|"
    r"don't love|no longer like|no longer enjoy|no longer love|don't really like|don't care for|"
    r"never liked|never really liked|have never liked|have never really liked|have never been (?:a fan of|into)|"
    r"am not into|'m not into|'re not into|am over|'m over|am done with|"
    r"'m done with|am sick of|'m sick of|am tired of|'m tired of|'m fed up with|am fed up with|"
    r"'m not (?:a |really a )?(?:big |huge )?fan of|am not (?:a )?(?:big |huge )?fan of|went off|"
    r"'ve gone off|have gone off|'ve gone off of|have gone right off|have gone completely off|have lost interest in|lost interest in|have fallen out of love "
    r"with|fell out of love with|have grown tired of|grew tired of|stopped liking|stopped enjoying|"
    r"have stopped liking|have stopped enjoying"
)
CONSUME = r"drink|eat|smoke|play|watch|do|listen to|read|touch|use|buy|wear"
HABIT = r"drink|eat|smoke|play|watch|listen to|read"
QUIT = r"stopped|quit|gave up|given up|cut out|kicked|quit on|ditched|dropped|packed in|jacked in|chucked in"
# leaving a job: "I quit the cafe", "I resigned from Boots"
LEAVE = (
    r"quit|left|resigned from|resigned|walked out of|walked away from|handed in my notice at|gave notice at|"
    r"packed in|jacked in|chucked in|"
    r"got (?:fired|laid off|let go|sacked) from|was (?:fired|laid off|let go|sacked) from|"
    r"stopped working at|stopped working for|stopped working in"
)
WORKPLACES_RE = alt(WORKPLACES)
# after a workplace left: the time of day or a moment ago, so the day's work, not the job, was left
FOR_THE_DAY = (
    r"\s+(?:early|late|today|tonight|at (?:\d|noon|lunch)|for (?:lunch|the day|the night|the weekend)|"
    r"this (?:morning|afternoon|evening)|(?:not (?:too |that |so )?long|a (?:few |couple of )?(?:minutes?|hours?)|"
    r"an hour|\w+ (?:minutes?|hours?)) ago)\b"
)
JOB_GERUNDS_RE = alt(JOB_GERUNDS)
FIELDS_RE = alt(FIELDS | JOB_GERUNDS)
# an organisation's name as said: capitalised words ("Accenture", "Boots", "Deutsche Bank")
ORG_NAME = r"(?P<org>(?-i:[A-Z])[\w&.'-]*(?: (?-i:[A-Z])[\w&.'-]*)*)"


# ---- spelling: one form for the patterns ----------------------------------------------------------------

_CONTRACTIONS = (
    (re.compile(r"\b(I|we)'m\b", re.I), r"\1 am"),
    (re.compile(r"\b(I|we)'re\b", re.I), r"\1 are"),
    (re.compile(r"\b(I|we)'ve\b", re.I), r"\1 have"),
)


_INTENSIFIERS = re.compile(
    r"\b(?:really|totally|absolutely|completely|kind of|kinda|sort of|pretty much|so|just(?! left\b)|actually|"
    r"definitely|honestly|seriously|literally|genuinely|truly|finally|officially|now|currently|recently|"
    r"basically|already)\s+(?=[a-z])",
    re.I,
)


def expand_contractions(text: str) -> str:
    """ "I'm" -> "I am", "we're" -> "we are", "I've" -> "I have", and intensifiers or time adverbs before a
    word dropped ("I'm so over it" -> "I am over it"): the patterns then need one spelling."""
    for pattern, replacement in _CONTRACTIONS:
        text = pattern.sub(replacement, text)
    return _INTENSIFIERS.sub("", text)


# ---- builders: a slot template and a value, both from the match ----------------------------------------


def user(attribute: str, value: Callable[[re.Match[str]], str | None]) -> Build:
    def build(m: re.Match[str]) -> tuple[str, str] | None:
        got = value(m)
        return (f"user|{attribute}", got) if got else None

    return build


def fixed(text: str) -> Callable[[re.Match[str]], str | None]:
    return lambda m: text


def group(name: str, normalize: Callable[[str], str | None]) -> Callable[[re.Match[str]], str | None]:
    return lambda m: normalize(m.group(name))


def lookup(name: str, table: dict[str, str], prefix: str = "") -> Callable[[re.Match[str]], str | None]:
    return lambda m: prefix + table[m.group(name).lower()]


def relative(attribute: str, value: Callable[[re.Match[str]], str | None]) -> Build:
    """A relative's slot, "sister|home_city"; a friend, cousin or colleague needs a name: "friend:tom|..."."""

    def build(m: re.Match[str]) -> tuple[str, str] | None:
        subject = v.relative_subject(m.group("rel"), m.groupdict().get("relname"))
        got = value(m)
        return (f"{subject}|{attribute}", got) if subject and got else None

    return build


def pet_name(m: re.Match[str]) -> tuple[str, str] | None:
    """A pet's name per species; "another dog", "a second cat", "also a dog" add a pet rather than rename."""
    if v.ADDS_ANOTHER.search(m.string, 0, m.end()) or v.ALSO_AT_END.search(m.string):
        return None
    groups = m.groupdict()
    raw_species = groups.get("species") or groups.get("species2") or groups["species3"]
    species = SPECIES[raw_species.lower()]
    raw_name = groups.get("name") or groups.get("name2") or groups.get("name3")
    name = v.name(raw_name) if raw_name else "none"
    return (f"user|{species}.name", name) if name else None


def favourite(m: re.Match[str]) -> tuple[str, str] | None:
    thing, value = v.thing(m.group("thing")), v.plain(m.group("val"))
    return (f"user|favourite:{thing}", value) if thing and value else None


# a taste turned round or held for a while only, later in the clause: "I've never liked olives until I tried them",
# "... but these ones are amazing", "I've gone right off chocolate for Lent"
_TURNED = re.compile(
    r"\b(?:until|till)\b|\bbut (?:now|these|this|that|those|lately|recently|then|I)\b|\bas a (?:kid|child)\b|\bwhen I was\b|\bfor (?:lent|now|the moment|a bit|a while)\b|"
    r"\bthis week\b|\bat the moment\b",
    re.I,
)


def likes(answer: str, attribute: str = "likes", group: str = "obj") -> Build:
    def build(m: re.Match[str]) -> tuple[str, str] | None:
        if v.MORE_OBJECTS.match(m.string, m.end(group)):
            return None  # "I love coffee and tea": two objects, one statement; no slot
        if _TURNED.search(m.string, m.end(group)):
            return None
        obj = v.thing_object(m.group(group))
        return (f"user|{attribute}:{obj}", answer) if obj else None

    return build


def rule(pattern: str, build: Build, kind: str = "fact") -> SlotRule:
    return SlotRule(re.compile(pattern, re.IGNORECASE), build, kind)


def likes_verb_any(m: re.Match[str]) -> tuple[str, str] | None:
    verb = (m.group("verb") or m.group("verb2")).lower()
    return (f"user|likes:{v.gerund(verb)}", "no") if verb not in v.NOT_ACTIVITIES else None


def relative_name(m: re.Match[str]) -> tuple[str, str] | None:
    rel = m.group("rel") or m.group("rel2")
    name = v.name(m.group("name") or m.group("name2"))
    subject = RELATIVES[rel.lower()]
    if not name or subject in v.NEEDS_NAME:
        return None
    return f"{subject}|name", name


def negated(normalize: Callable[[str], str | None], *names: str) -> Callable[[re.Match[str]], str | None]:
    """ "not:<value>" of the first group of `names` that matched: the statement retires that one value ("I
    don't live in Bern anymore")."""

    def build(m: re.Match[str]) -> str | None:
        raw = next((m.group(n) for n in names if m.group(n)), None)
        got = normalize(raw) if raw else None
        return f"not:{got}" if got else None

    return build


def only(m: re.Match[str]) -> tuple[str, str] | None:
    """ "I only drink tea" -> ("user|only:drink", "tea"): consolidation retires the other things the user
    was said to drink (see `consolidate.ONLY_PREFIX`)."""
    if v.MORE_OBJECTS.match(m.string, m.end("obj")):
        return None
    obj = v.thing_object(m.group("obj"))
    return (f"user|only:{m.group('verb').lower()}", obj) if obj else None

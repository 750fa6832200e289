"""How a memory reads in the prompt: the user's first-person statement told about the user, in the third person
("I live in Lisbon." -> "The user lives in Lisbon."; "My dog is Miso." -> "The user's dog is Miso."), so the
model reads the memory block as context about someone else and answers in its own voice, not the user's.

Pure word rewriting over one memory's text, deterministic (a memory's line is part of a block's token ids:
both the KV block and the text path encode exactly this text). Knows nothing of tokenizers or layouts.
"""

from __future__ import annotations

import re

_USER = "the user"
# words that stand between the subject and its verb ("I really love", "I no longer eat")
_ADVERBS = frozenset(
    """
    also always really just still now currently usually often sometimes never rarely mostly only actually
    recently finally totally absolutely definitely honestly truly already even no longer generally
    normally basically kind sort of mainly almost
    """.split()
)
# verbs after "I" that stay as they are for "the user": modals, past forms, and "quit/put/let/cut/set/hit/read"
_AS_IS = frozenset(
    """
    can could will would should shall may might must did didn't can't cannot won't wouldn't couldn't shouldn't
    mustn't was wasn't were had used went got saw met came left took made ate drank bought began found gave
    told felt ran won lost sold spent paid wrote broke flew drove caught kept brought heard sent slept swam
    threw woke wore became quit put let cut set hit read thought knew grew fell rode sang taught understood
    stood sat lay led forgot chose hid built meant shut
    """.split()
)
_IRREGULAR = {
    "am": "is",
    "'m": "is",
    "are": "is",
    "'re": "is",
    "have": "has",
    "'ve": "has",
    "haven't": "hasn't",
    "do": "does",
    "don't": "doesn't",
    "'d": "would",
    "'ll": "will",
    "were": "was",
    "weren't": "wasn't",
    "aren't": "isn't",
}
_CONTRACTED = {"m": "is", "ve": "has", "re": "is", "d": "would", "ll": "will"}
_CONTRACTED_PLURAL = {"m": "am", "ve": "have", "re": "are", "d": "would", "ll": "will"}
_ADVERB_RUN = "|".join(
    sorted((re.escape(a) for a in _ADVERBS | {"no longer", "kind of", "sort of"}), key=len, reverse=True)
)
# a first-person subject, its contraction, the adverbs after it and its verb: "I'm", "we really love"
_SUBJECT = re.compile(
    rf"(?P<and>\band\s+)?\b(?P<subj>(?-i:I|i(?!\.))|we)(?:'(?P<contr>m|ve|re|d|ll))?\b"
    rf"(?P<adv>(?:\s+(?:{_ADVERB_RUN})\b)*)(?:\s+(?P<verb>[A-Za-z]+n't|[A-Za-z]+)(?![\w']))?",
    re.I,
)
_POSSESSIVE = re.compile(r"\b(?:my|our|mine|ours)\b", re.I)
_OBJECT = re.compile(r"\b(?-i:me|us)\b|\b(?:myself|ourselves)\b", re.I)
_FIRST_PERSON = re.compile(
    r"\b(?:(?-i:I|i(?!\.))|we|my|our|mine|ours|(?-i:me)|(?-i:us)|myself|ourselves)\b", re.I
)


def _third_singular(verb: str) -> str:
    """ "live" -> "lives", "watch" -> "watches", "study" -> "studies"; forms that stay, unchanged."""
    low = verb.lower()
    if low in _IRREGULAR:
        return _IRREGULAR[low]
    if low in _AS_IS or low.endswith("ed") or not low.isalpha():
        return verb
    if low.endswith(("s", "sh", "ch", "x", "z", "o")):
        return verb + "es"
    if low.endswith("y") and len(low) > 1 and low[-2] not in "aeiou":
        return verb[:-1] + "ies"
    return verb + "s"


def _subject(m: re.Match[str]) -> str:
    plural = m.group("and") is not None  # "my wife and I live": the verb stays plural
    out = (m.group("and") or "") + _USER
    contr, adv, verb = m.group("contr"), m.group("adv") or "", m.group("verb")
    if contr:
        out += " " + (_CONTRACTED_PLURAL if plural else _CONTRACTED)[contr.lower()]
    out += adv
    if verb:
        out += " " + (verb if plural or contr else _third_singular(verb))
    return out


def third_person(text: str) -> str:
    """The memory told about the user in the third person; a text with no first-person word is unchanged
    (but for its spaces, collapsed as in every memory line)."""
    text = " ".join(text.split())
    if not _FIRST_PERSON.search(text):
        return text
    text = _SUBJECT.sub(_subject, text)
    text = _POSSESSIVE.sub(lambda m: "the user's", text)
    text = _OBJECT.sub(
        lambda m: (
            "themselves" if m.group(0).lower().endswith("selves") or m.group(0).lower() == "myself" else _USER
        ),
        text,
    )
    return text[:1].upper() + text[1:]

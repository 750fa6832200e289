"""What opens a clause, and the user as its subject (part of cutting a message into statements, `clauses.py`):
discourse markers and frames that only announce a statement ("well", "Please note that"), leading dates, adverbs
and phrases ("On 2026-11-25, ...", "After the mole scare ..."), a first-person subject or one of the few statements
shaped otherwise ("call me Sam", "Berlin is home now"), and a subject chat dropped, put back ("Moved to Oslo" -> "I
Moved to Oslo").
"""

from __future__ import annotations

import re

from kvmem.formation.dates import RELATIVE_DATE
from kvmem.formation.lexicon import (
    DISCOURSE_MARKERS,
    DIVORCE_THROUGH,
    DROPPED_BE,
    DROPPED_I,
    ED_NOT_PAST,
    EMPLOYER_SUBJECT,
    HIRER_SUBJECT,
    JOKED_PARTNERS,
    OCCUPATIONS,
    PAST_VERBS,
    SUBJECTLESS_FILLER,
    WORKPLACES,
)

_MARKERS = "|".join(sorted((re.escape(m) for m in DISCOURSE_MARKERS), key=len, reverse=True))
# (not the "no" of "No more sugar in my tea", "No longer vegan")
_LEADING_MARKER = re.compile(rf"^(?:(?:{_MARKERS})\b(?!\s+(?:more|longer)\b)[,:!.]*\s*)+", re.I)

# Leading adverbials allowed before the subject: resolved dates ("On 2026-11-25, I ..."), time adverbs.
_DATE_PHRASE = (
    r"(?:on|in|since|from|during|around|until) (?:the (?:morning|afternoon|evening|night|week|weekend) of )?"
    r"(?:\d{4}-\d\d-\d\d|[A-Z][a-z]+ \d{4}|\d{4})"
)
# "After years in Lisbon, I ...", "When I was a kid, I ...": a leading phrase up to a comma (after a
# preposition, one with no subject of its own, so "In 2019 I moved to Berlin," is not taken for one).
_LEADING_PHRASE = (
    r"(?:(?:after|before|since|when|while|as|because|although|though|once|until|ever since|back when)\b[^,]{1,60}|"
    r"(?:at|in|on|by|from|for|with|without|during|despite)\b(?:(?!\b(?:I|we)\b)[^,]){1,60}),|"
    # or with no comma, up to the user as subject: "After the mole scare I've given up sunbathing", "After thirty
    # years in newsrooms I've gone into comms" (nothing of the user's own in it; not "since": "Since the move I've
    # been calmer" tells a state as it is)
    r"(?:after|following)(?:\s+(?!(?:I|I'm|I've|we|we're|we've|me|us|and|but|so)\b)[^\s,.;!?]+){3,7}(?=\s+(?:I|we)\b)"
)
_ADVERBIAL = re.compile(
    rf"^(?:(?:{_DATE_PHRASE}|{RELATIVE_DATE.pattern}|earlier today|sadly|unfortunately|luckily|fortunately|"
    r"happily|thankfully|surprisingly|obviously|apparently|recently|lately|now|currently|also|finally|just(?! left\b)|"
    r"then|still|so|and|but|these days|nowadays|at the moment|right now|as of now|for now|these past \w+ \w+|"
    r"over the \w+|a while ago|a few \w+ ago|at last|earlier|today|this week|after all|in the end|by day|"
    r"by night|by trade|honestly|personally|weirdly|oddly|funnily enough|strangely|ironically|amazingly|"
    r"annoyingly|basically|literally|seriously|genuinely|technically|officially|suddenly|usually|normally|"
    r"generally|typically|mostly|often|sometimes|always|"
    r"as of (?:now|today|this \w+|last \w+)|(?:from|starting|since) (?:this|last) (?:week|month|year|term|spring|"
    r"summer|autumn|winter)|"
    # non-native "Since two weeks I live in Wrocław" (for two weeks)
    r"since (?:\d+|a|one|two|three|four|five|six|seven|eight|nine|ten|a few|some|many) (?:days?|weeks?|months?|"
    r"years?)|"
    r"(?:in|since|from|as of) (?:january|february|march|april|may|june|july|august|september|october|november|"
    r"december)"
    rf"(?: \d{{4}})?|(?:since|from|as of) (?:last |this )?(?:monday|tuesday|wednesday|thursday|friday|saturday|"
    rf"sunday))\b,?|{_LEADING_PHRASE})\s+",
    re.I,
)
_SUBJECT = re.compile(
    r"^(?:I|I'm|I've|I'd|I'll|my|we|we're|we've|we'd|we'll|our|me and|myself|mine|"
    rf"(?!(?:{JOKED_PARTNERS}) )(?-i:[A-Z])[a-z]+ and (?:I|me)|"
    r"the [\w'-]+ and I)\b(?!-)",
    re.I,
)
_OCCUPATIONS = "|".join(sorted(OCCUPATIONS, key=len, reverse=True))
# "Green is now my favourite colour", "call me Sam": first-person statements without a first-person subject.
ALSO_ABOUT_USER = re.compile(
    r"^(?:[\w' -]{1,40} (?:is|are|has always been|has been|was always) (?:now |still |officially |definitely )?"
    r"my (?:new |all-time |absolute )?(?:favou?rite|fave?|guilty pleasure|jam|thing|home)\b|"
    r"home (?:is|for me is)\b|[\w' -]{1,30} is (?:now )?home\b|"
    # a taste told with the thing first: "Gardening bores me to tears", "Camping is my idea of hell"
    r"[\w' -]{1,40} (?:(?:really |just |always |totally )?(?:bores?|bored|annoys?|irritates?|terrifies|scares?|"
    r"disgusts?|fascinates?|excites?) me|(?:has|have) (?:never|always) (?:interested|appealed to|bored) me|"
    r"(?:is|are)(?: not|n't)? (?:really )?my (?:idea of|cup of tea|kind of))\b|"
    r"(?:you can |please |just )?call me [A-Za-z][\w'-]*$|people call me\b|everyone calls me\b|"
    # the user's relationship told from the other side: "Karl broke up with me", "Bea is my wife now"
    r"(?-i:[A-Z])[a-z]+ (?:just )?(?:broke up with me|dumped me|left me|ended things with me|ended it with me|"
    r"divorced me|split up with me|proposed)\b|"
    rf"{DIVORCE_THROUGH}(?:$|(?=,|\s+(?:on|in|last|this|yesterday|today|at last)\b))|"
    r"(?-i:[A-Z])[a-z]+ is (?:now |officially )?my "
    r"(?:wife|husband|fianc\w*|girlfriend|boyfriend|partner)\b|the engagement is (?:off|over)\b|"
    r"(?-i:[A-Z])[a-z]+ (?:has |just )?ghosted me\b|"
    r"(?:the|our|my) engagement(?:'s| is) (?:off|over)\b|"
    r"(?:the|my) (?:missus|wife|husband|hubby|other half|partner) (?:has |'s )?(?:just )?(?:left me|walked out)\b|"
    # the user's job told from the employer's side: "They've made me practice manager", "The plant took me on"
    rf"{HIRER_SUBJECT} (?:just |finally |officially )?(?:promoted me|took me on|taken me on|hired me|offered me the "
    rf"job)\b|{EMPLOYER_SUBJECT} (?:just |finally |officially )?made me (?:a |an |their )?(?:new )?(?:[\w-]+ ){{0,2}}"
    rf"(?:{_OCCUPATIONS})s?\b)",
    re.I,
)

# a frame that only announces the statement after it: "Please note that I have relocated ...", "I should like to tell
# you that I have become engaged ...", "I am pleased to report that I have accepted a post ...", "Please I have
# shifted to Accra" (a polite "please" before the subject, as West African English uses it); not a wish or a word
# said for another ("I want to say I quit", "I had to say I'm single", "Note that I'm a doctor in this roleplay")
_FRAME = re.compile(
    r"^(?:please (?:note|be advised)|I (?:should|would|'d) like to (?:tell|inform) you|"
    r"I (?:just )?(?:wanted|thought I'd) to (?:tell you|let you know)|"
    r"I(?:'m| am) (?:so |very |really )?(?:pleased|happy|glad|sad|sorry|proud|delighted|thrilled) to "
    r"(?:report|say|tell you|announce|share|inform you|let you know)|(?:just )?(?:to )?let(?:ting)? you know)"
    r"(?: that)?[,:]?\s+(?=\S)|^please,? (?=I\b)",
    re.I,
)


# a story or a game: what follows a frame there is not the user's ("Please note that I am a pilot for this story")
_MAKE_BELIEVE = re.compile(
    r"\b(?:story|roleplay|role-play|role play|pretend|game|character|scenario)\b", re.I
)


def strip_markers(text: str) -> str:
    text = _LEADING_MARKER.sub("", text).strip()
    framed = text if _MAKE_BELIEVE.search(text) else _FRAME.sub("", text, count=1)
    return _LEADING_MARKER.sub("", framed).strip() if framed != text else text


def strip_adverbials(text: str) -> str:
    """The clause from its subject on: leading dates and time adverbs removed (at most three)."""
    for _ in range(3):
        stripped = _ADVERBIAL.sub("", text, count=1)
        if stripped == text:
            break
        text = stripped
    return text


# an adjective and a noun, then a verb: the two words are the clause's subject ("Retired people get ...")
_NOUN_PHRASE_SUBJECT = re.compile(
    r"^[A-Za-z']+ [A-Za-z']+ (?:are|is|get|gets|have|has|keep|keeps|always|never|can|can't|should|will|won't|were|"
    r"was|do|don't|does|make|makes|tend)\b",
    re.I,
)
FIRST_WORD = re.compile(r"^[A-Za-z']+(?= \w)")  # a word and then another: "Absolutely, ..." is not one


# "Gone veggie", "gone dairy-free", "gone off coffee": a state; not a place or an errand ("Gone home", "gone to the
# shops", "gone out for a bit")
_GONE_TO_A_STATE = re.compile(
    r"^gone (?!(?:to|home|out|for|in|into|back|down|up|over|through|round|around|away|abroad|shopping|quiet|"
    r"missing|mad|crazy|well|badly|wrong|on|by|past|now|already|a|an|the|part-time|part|full-time|full|remote)\b)",
    re.I,
)
# "Cut out sugar", "Cut the sugar out of my tea", "cut down on meat": a habit cut; not "Cut my finger", "Cut to part
# time", "Cut my Netflix for a month"
_CUT_A_HABIT = re.compile(r"^cut (?:out|down|back|(?:the |my )?[\w'-]+ out)\b", re.I)
# a change told in one word: "Quit.", "Retired!"
_ONE_WORD_CHANGE = frozenset({"quit", "resigned", "retired"})


def _restore_subject(core: str) -> str | None:
    """The clause with the subject chat dropped put back ("Moved to Oslo" -> "I Moved to Oslo", "Been
    living here" -> "I have Been living here", "Not into it" -> "I am Not into it"), or None."""
    if core.lower().strip(" .!?") in _ONE_WORD_CHANGE:
        return f"I {core.strip(' .!?')}"
    m = FIRST_WORD.match(core)
    if m is None or core.lower().rstrip(" .!?") in SUBJECTLESS_FILLER or len(core.split()) < 2:
        return None
    word = m.group(0).lower()
    if _NOUN_PHRASE_SUBJECT.match(core):
        # "Married couples get a tax break", "Retired teachers are the best": a subject of its own
        return None
    if word == "been" or (word == "gone" and _GONE_TO_A_STATE.match(core)):  # "Gone veggie since January"
        return f"I have {core}"
    if word == "cut" and not _CUT_A_HABIT.match(core):
        return None
    if word in ("not", "no") or word in DROPPED_BE:
        return f"I am {core}"
    if (
        word in DROPPED_I
        or word in PAST_VERBS
        or (word.endswith("ed") and len(word) > 3 and word not in ED_NOT_PAST)
    ):
        return f"I {core}"
    return None


# a change said in Scots, read in the standard form the slots know (the fact keeps the user's words): "That's me
# retired fae the yard" (I'm retired from), "That's me redundant" (not "That's me retired to bed", "... retired from
# five-a-side", "... unemployed for the summer": said last, or before "fae"/"from" and a workplace), "I'm nae a postie
# any more" (not)
_WORKS = "|".join(
    sorted(WORKPLACES | {"job", "work", "yard", "shipyard", "pit", "pits", "mine", "rigs", "force", "police", "army",
     "navy", "council"}, key=len, reverse=True)
)  # fmt: skip
_THATS_ME = re.compile(
    r"^that's me (?:now |officially )?(?=(?:retired|unemployed|redundant|divorced)(?:\s*$|,| (?:fae|from) "
    rf"(?:the |my )?(?:[\w'-]+ )?(?:{_WORKS})(?:\s*$|,)))",
    re.I,
)
_NAE = re.compile(r"^(I(?:'m| am)) nae\b", re.I)
_FAE = re.compile(r"\b(retired|redundant) fae\b", re.I)


def standard_english(core: str) -> str:
    """`core` with a change said in Scots put in the standard form (`_THATS_ME`, `_NAE`)."""
    thats = _THATS_ME.match(core)
    if thats is not None:
        core = f"I'm {core[thats.end() :]}"
    return _FAE.sub(r"\1 from", _NAE.sub(r"\1 not", core, count=1))


def subject_core(clause: str, dropped: bool = True) -> str | None:
    """The clause from its subject on (leading dates and adverbs stripped) when it states something of the
    user: "I ...", "my ...", "we ...", one of the few statements shaped otherwise ("call me Sam", "Berlin is
    home now"), or, with `dropped`, a chat clause whose subject was dropped, put back; else None."""
    core = standard_english(strip_adverbials(clause))
    if _SUBJECT.match(core) or ALSO_ABOUT_USER.match(core):
        return core
    return _restore_subject(core) if dropped else None


def is_first_person(clause: str, dropped: bool = False) -> bool:
    """Whether `subject_core` finds a statement of the user; an explicit subject only, unless `dropped`."""
    return subject_core(clause, dropped) is not None

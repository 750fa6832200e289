"""Words of change: whether a clause says that a state of the user's began, ended or moved (a home, a job, a
partner, a taste or habit), as the rules read it, apart from whose it is or when (change_guard.blocker's to say).

`says_change(clause, strict)`: a word of change (`CHANGED`) other than one that only says when ("now", "finally");
`strict`, nor one of how long or since when ("for years", "since", "used to"), except "any more" after a negation,
which says a state is over. `says_given_up`: a taste or habit given up ("gone right off", "stopped", "no more"), not
taken up. `says_state_change`: a word of change other than a taste taken up ("got into", "learning"), what a home,
a job or a partner's change needs. Pure functions over text; no state.
"""

from __future__ import annotations

import re

# a state that began, ended or moved, in the areas the rules read (work, home, partner, tastes and habits)
_CHANGES = (
    # home
    r"mov(?:e|ed|ing)", r"relocat\w+", r"emigrat\w+", "settled", r"shift(?:ed|ing) (?:(?:up|down|over|back|out) )?(?:to|over|back)",
    "sold up", "moved back home",
    "keys to", "own place",
    r"(?:I'm|I am|we're|we are) (?:\w+ )?out of (?:the|that|my|our) (?:\w+ )?(?:flat|house|place|suite|dorms?|"
    "halls|apartment|room|job|company|firm|army|navy|marriage|relationship)",
    r"(?:got|rented|found) (?:a|an|our|my) (?:\w+ ){0,2}(?:condo|apartment|flat|house|home|place|bungalow|terrace|"
    "semi|cottage|room)",
    # work
    "new (?:job|role|position|post|gig|place|flat|house|home|apartment|city|town|partner|girlfriend|boyfriend|"
    "company|firm|employer|team|school|contract|career|chapter)", r"quit(?:s|ting|ted)?", "left", r"leav(?:e|ing)",
    r"resign\w*", r"hand(?:ed|ing)? in", "(?:gave|given|giving|put in|served|my) (?:my )?notice",
    r"(?:pack|jack)(?:ed)? (?:it )?in", r"walk(?:ed|ing) (?:out|away)", "laid (?:(?:me|us) )?off", r"redundan\w+", "fired",
    "sacked", "let (?:(?:me|us) )?go", "the sack", "stepped down (?:as|from)", "last (?:day|shift|ever|patient|time)", "cleared out", "retirement",
    "(?:took|drew|drawing|taking|on) (?:my |a |the )?pension",
    r"(?:that's|it's) (?:\w+ )?(?:done|finished)", "first (?:day|week|month|shift)", "started", "starting",
    "start (?:at|as|with|work|my|a|an|on)", "t(?:ook|aken) (?:a|the|up a|up the) (?:job|post|position|role)",
    "got (?:a|the) (?:job|post|position|role|place)", "transferred", "graduated", "qualified", "bought", "again",
    "began", "begun", "commenced", "join(?:ed|ing)", "hired", "sign(?:ed|ing) (?:on|up)", "taken on",
    "t(?:ook|aken) (?:me|us) on (?:as|full-time|permanently)", "got a start", "landed", "promoted",
    "switch(?:ed|ing)", "swap(?:ped|ping)", "chang(?:ed|ing)", "became", "become", r"retir\w+",
    r"re(?:married|trained|skilled)",
    # partner
    "married", "wed", "wedding", "engaged", r"propos\w+", "dating", "seeing (?:someone|a|this)",
    "got together", "getting together", "asked (?:me|us) out", "back together", "moved in together", "in a relationship", "tied the knot", "made it official", "split",
    "broken? up", "break-?up", r"call(?:ed|ing) (?:the|our|my) (?:engagement|wedding) off", "left me", r"divorc\w+", "separat(?:ed|ing)", "dumped", "ended", "called it (?:a day|quits)",
    "single", r"widow\w*", "exclusive", "(?:are|'re) (?:done|finished|through)", "(?:we're|we are) (?:officially )?(?:a|an) (?:thing|item|couple)", r"^(?:me and|(?-i:[A-Z])[a-z]+ and (?:I|me)\b)[\w' -]* are (?:officially )?(?:a|an) (?:item|couple)(?! of)",
    "passed away", "died", "lost", "gone", "ex",
    # tastes and habits
    "g(?:ave|iven|iving|ive) up", "stop(?:ped|ping)?", "cut(?:ting)? out", "ditch(?:ed|ing)", "dropp(?:ed|ing)",
    "done with", "over (?:it|him|her)", "sold", "deleted", "cancell?ed", "kicked", r"gone (?:right |completely )?off",
    "(?:a|now a) convert",
    "off (?:the|meat|booze|dairy|sugar|caffeine|alcohol)",
    "(?:went|gone|going|turned) (?:vegan|veggie|vegetarian|plant-based|teetotal|sober|keto|pescatarian|dry)",
    "sober", "t(?:ook|aken|aking|ake) up", "got into", "getting into", "picked up", "learning", "hooked",
    "obsessed", "come to (?:love|like|enjoy|hate)",
    "got (?:a|an|my) (?:boyfriend|girlfriend|partner|job|place|flat|house)",
    # how long, and since when
    r"been (?:a|an|\w+ing)",
    r"for (?:\d+|a|an|two|three|four|five|six|seven|eight|nine|ten|twenty|thirty|over|nearly|almost|about) "
    r"(?:\w+ )?(?:years?|months?|weeks?|decades?)",
    "since", "used to", "no longer", "no more", "any ?more", "over with", "(?:it's|that's|we're) over",
    "these days", "nowadays", "now", "for good", "finally", "officially",
)  # fmt: skip
CHANGED = re.compile(rf"\b(?:{'|'.join(_CHANGES)})\b", re.I)


# words of change that also say only when ("I'm cooking mushrooms for the kids now"): not enough to tell a change
# of a taste alone; nor, for a state read from words alone (tells_change's `strict`), words of how long or since
# when, or "learning", which real chat uses all the time ("I have since found calculus useful", "I've been working from
# home for a while", "get my food and leave", "Excited for the challenges and learning ahead")
_ONLY_WHEN = re.compile(r"\b(?:now|these days|nowadays|finally|officially|again)\b", re.I)
_ONLY_HOW_LONG = re.compile(
    r"\b(?:(?:ever )?since|any ?more|used to|leav(?:e|ing)|learning|been (?:a|an|\w+ing)|"
    r"for (?:\w+ ){1,2}(?:years?|months?|weeks?|decades?))\b",
    re.I,
)
# except a state said to be over: "any more" after a negation ("Not seeing Ollie any more", "I don't eat meat anymore")
_NOT_ANY_MORE = re.compile(
    r"(?:\b(?:not|no|never)\b|n't\b)(?! (?:know|think|understand|remember)\b)[^,.;:!?]*\bany ?more\b", re.I
)


def says_change(clause: str, strict: bool = False) -> bool:
    """Whether the clause has a word of change other than one that only says when ("Uninstalled WoW and cancelled
    the sub", not "I'm cooking mushrooms for the kids now"); `strict`: nor one of how long or since when ("I've been
    a nurse for years"). What the guard blocks is `blocker`'s to say."""
    words = _ONLY_WHEN.sub(" ", clause)
    if strict and not _NOT_ANY_MORE.search(words):
        words = _ONLY_HOW_LONG.sub(" ", words)
    return bool(CHANGED.search(words))


# a taste or habit given up: what a change of taste told in words alone must say (taking one up rarely ends another:
# "I've recently started playing Spider-Man" beside "I started playing the Guardians of the Galaxy game")
_GIVEN_UP = re.compile(
    r"\b(?:g(?:ave|iven|iving|ive) up|stop(?:ped|ping)|stop \w+ing|put an? (?:\w+ )?stop to|quit(?:ting)?|"
    r"cut(?:ting)? (?:\w+ ){0,3}out|ditch(?:ed|ing)|dropp(?:ed|ing)|done with|(?:gone|went|going) (?:right |completely )?off|fallen out of love|no longer|no more|"
    r"(?:are|'re) (?:done|finished|through)|kicked|over (?:it|him|her))\b",
    re.I,
)


# a taste or habit taken up: a word of change that tells nothing of a home, a job or a partner
_TAKEN_UP = re.compile(
    r"\b(?:t(?:ook|aken|aking|ake) up|got into|getting into|picked up|learning|hooked|obsessed|"
    r"come to (?:love|like|enjoy|hate)|(?:a|now a) convert)\b",
    re.I,
)


def says_state_change(clause: str) -> bool:
    """Whether the clause has a word of change (`says_change`, strict) other than one of a taste taken up ("I used to
    make barbecue before I got into comic books" tells no new job)."""
    return says_change(_TAKEN_UP.sub(" ", clause), strict=True)


def says_given_up(clause: str) -> bool:
    """Whether the clause says a taste or habit was given up ("I've gone right off online chess", "Not seeing Ollie
    any more"), not taken up."""
    return bool(_GIVEN_UP.search(clause) or _NOT_ANY_MORE.search(clause))

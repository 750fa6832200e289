"""A user's message cut into candidate statements: sentences, then clauses joined by "and"/"but" or a comma
where each side is a full first-person statement; then the ones that are not memory are dropped (greetings,
questions, requests, filler, hedged hypotheticals, statements about the assistant). A chat clause whose
subject was dropped ("Moved to Oslo last month") counts as the user's; `subject_core` puts the "I" back.

Knows nothing of dates, slots or facts: it returns the kept clauses as said, minus discourse markers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvmem.formation.dates import MONTHS, RELATIVE_DATE, WEEKDAYS
from kvmem.formation.lexicon import (
    DISCOURSE_MARKERS,
    DIVORCE_THROUGH,
    DROPPED_BE,
    DROPPED_I,
    ED_NOT_PAST,
    EMPLOYER_SUBJECT,
    FILLER_CLAUSES,
    HIRER_SUBJECT,
    JOKED_PARTNERS,
    OCCUPATIONS,
    PAST_VERBS,
    RELATIVES,
    SUBJECTLESS_FILLER,
)


@dataclass(frozen=True)
class Clause:
    """One kept statement: `text` as said (markers stripped, no end punctuation); `correction` when the
    sentence opened with "actually", "correction", "sorry" or "no wait"."""

    text: str
    correction: bool = False


_EMOJI = re.compile("[\U0001f000-\U0001faff\u2600-\u27bf\ufe0f\u200d]+|(?<!\\w)[:;]-?[()dDpP3](?!\\w)")
_SPACES = re.compile(r"\s+")
_QUOTES = str.maketrans({"\u2019": "'", "\u2018": "'", "\u201c": '"', "\u201d": '"', "\u2014": " - "})
# Chat spellings: "im" -> "I'm", a lone lowercase "i" -> "I", "dont" -> "don't".
_CHAT_SPELLINGS = (
    (re.compile(r"\b[iI]m\b"), "I'm"),  # "Im", "im": a capital does not make it another word
    (re.compile(r"\b[iI]ve\b"), "I've"),
    # a negation typed without its apostrophe ("dont", "cant", "Didnt"): the slots read "don't" ("I dont like X"
    # was a plain fact, not the dislike that "I don't like X" is)
    (
        re.compile(r"\b(do|does|did|ca|wo|is|was|are|were|have|has|had|would|could|should)nt\b", re.I),
        r"\1n't",
    ),
    (re.compile(r"\bi(?=\b|')"), "I"),
    (re.compile(r"(?<=[a-z]) n (?=[a-z])"), " and "),  # "me n my gf", "work n sleep"
)

_ABBREVIATIONS = re.compile(r"(?:\b(?:dr|mr|mrs|ms|st|prof|jr|sr|vs|etc|approx|no)|\b(?:e\.g|i\.e))\.$", re.I)
# ... and a laugh typed mid-message, where chat puts no full stop ("I dont remember lol but i work in a clinic")
_SENTENCE_END = re.compile(
    r"(?<=[.!?])\s+|\s*\n+\s*|\s*;\s*|\s+-\s+|:\s+|\s+(?:lol|lmao|haha+|hehe)[.!]*\s+(?=\w)(?!at\b|about\b)",
    re.I,
)

_MARKERS = "|".join(sorted((re.escape(m) for m in DISCOURSE_MARKERS), key=len, reverse=True))
# (not the "no" of "No more sugar in my tea", "No longer vegan")
_LEADING_MARKER = re.compile(rf"^(?:(?:{_MARKERS})\b(?!\s+(?:more|longer)\b)[,:!.]*\s*)+", re.I)
_CORRECTION = re.compile(r"^(?:actually|correction|sorry|no wait|wait|oops)\b", re.I)
_TRAILING_FILLER = re.compile(
    r"(?:[,\s]+(?:you know|you see|lol|haha+|hehe|honestly|actually|though|right|ok|okay|btw|by the way)|"
    r",\s*just like that)+\s*[.!?]*$",
    re.I,
)

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
    r"happily|thankfully|surprisingly|obviously|apparently|recently|lately|now|currently|also|finally|just|"
    r"then|still|so|and|but|these days|nowadays|at the moment|right now|as of now|for now|these past \w+ \w+|"
    r"over the \w+|a while ago|a few \w+ ago|at last|earlier|today|this week|after all|in the end|by day|"
    r"by night|by trade|honestly|personally|weirdly|oddly|funnily enough|strangely|ironically|amazingly|"
    r"annoyingly|basically|literally|seriously|genuinely|technically|officially|suddenly|usually|normally|"
    r"generally|typically|mostly|often|sometimes|always|"
    r"as of (?:now|today|this \w+|last \w+)|(?:from|starting|since) (?:this|last) (?:week|month|year|term|spring|"
    r"summer|autumn|winter)|"
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
_ALSO_ABOUT_USER = re.compile(
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

_QUESTION_START = re.compile(
    r"^(?:what|who|whom|whose|where|when|why|how|which|is|are|am|was|were|do|does|did|can|could|would|will|"
    r"should|shall|may|might|have|has|had|isn't|aren't|don't|doesn't|didn't|won't|wouldn't|can't|any|anything|"
    r"any ideas|thoughts|ideas)\b",
    re.I,
)
_HYPOTHETICAL = re.compile(
    r"\b(?:if|unless|whether|suppose|supposing|imagine|hypothetically|in theory|let's say|wish|pretend)\b"
    r"|^(?:had|were) (?:I|we)\b",  # "Had I joined my dad's business, I'd be running it by now"
    re.I,
)
_ABOUT_ASSISTANT = re.compile(r"\b(?:you|you're|you've|you'll|you'd|your|yours|yourself|u|ur)\b", re.I)
_REQUEST = re.compile(
    r"^(?:I|we) (?:(?:really |just |would |'d )?(?:need|want|would like|'d like|wanna) (?:you|to know|to ask|"
    r"to learn about|to understand|help|some help|advice|some advice|a recipe|some ideas|ideas|suggestions|"
    r"recommendations|a list|an example|more info|information|a summary)|(?:have|got) a (?:quick )?question|"
    r"(?:was|am|'m) (?:wondering|curious|asking)|(?:need|want) (?:a|an|some) (?:recipe|idea|suggestion|tip|"
    r"recommendation|plan|summary|list|explanation))",
    re.I,
)
_HEDGE = re.compile(
    r"^(?:I|we) (?:might|may|could|should|would|must|hope|wonder|doubt)\b|"
    r"^(?:I|we)(?:'d| would) (?!love to|like to|prefer|rather)|"
    r"^(?:I|we) (?:think|guess|suppose|believe|feel like|reckon|bet) (?:that )?(?:I|we|my|our|it|maybe)\b|"
    r"^(?:I|we) (?:should|could|might) (?:probably|maybe|definitely|really)\b|"
    r"^(?:I|we)(?:'m| am|'re| are) (?:probably|maybe|possibly)\b",
    re.I,
)
# A short clause whose object is only a pronoun reacts to what was said: "I love it", "I'll try that".
_PRONOUN_REACTION = re.compile(
    r"^(?:\S+\s+){0,4}(?:it|that|this|them|those|these)(?: too| so much| a lot| as well)?$", re.I
)
# Talk about the conversation itself: "I mixed that up", "I misspoke", "I made a typo"; leaving it or stepping
# away ("I'm off to bed, night night", "had to step away", "went quiet there"); a reaction to what was said
# ("I never knew that"). Each ends its clause, so "I've got to go to dialysis" and "I never knew that I was
# allergic" are statements.
_LEAVE_END = r"(?:,|!|$| now(?:,|!|$)| for a (?:bit|sec|minute))"
_META = re.compile(
    r"^I (?:misspoke|mixed (?:that|it|them|things) up|got (?:that|it) wrong|made a (?:typo|mistake)|was wrong|"
    r"meant to say|mis-?typed)\b|"
    rf"^(?:I(?:'m| am) off to (?:bed|sleep)|I(?:'m| am) off{_LEAVE_END}|(?:I )?(?:(?:had|have|got|need) to|gotta) "
    rf"(?:step away|pop out|dash|run|go){_LEAVE_END}|I(?:'ve| have) got to (?:go|run|dash){_LEAVE_END}|"
    r"(?:I )?(?:never knew|didn't know) that(?:,|!|$| about\b| before\b)|"
    rf"(?:I )?went (?:quiet|silent|awol|missing|offline)(?: there| on you)?{_LEAVE_END})",
    re.I,
)

# What passes with the day, not what is true of the user: a state of the moment ("I'm knackered", "I'm so
# hungry"), a bare reaction ("Kinda nice", "So good"), an exclamation about time ("Can't believe it's nearly
# the end of the year", no first-person word after it: "Can't believe it's my last day at Boots" is kept).
# Each must be the whole clause: "I'm tired of my job" and "I'm full-time now" are kept.
_PASSING = re.compile(
    r"^(?:I(?:'m| am) (?:(?:so|really|very|a bit|a little|pretty|absolutely|completely|totally|proper|well|"
    r"dead|super|just|rather|quite|bloody)\s+)*(?:knackered|exhausted|shattered|tired|sleepy|hungry|"
    r"starving|stuffed|full|bored|buzzing|freezing|boiling|cold|hot|sore|wiped out|done in|beat|wrecked|"
    r"fried|cream(?:ed|crackered)|pooped|drained|zonked|hungover)|(?:I )?(?:(?:kinda|so|pretty|really|"
    r"quite|very|actually|soo+)\s+)+(?:nice|good|great|cool|lovely|fun|weird|funny|crazy|mad|wild|"
    r"brilliant|awesome|amazing|annoying|boring|relaxing|peaceful|quiet|busy)|(?:I )?can(?:'t|not) believe "
    r"(?:it's|it is|how) (?:already|nearly|almost|only|been|fast|quick|quickly)\b(?!.*\b(?:I|I'm|my|me)\b)"
    r".*)$",
    re.I,
)
# A thank-you to the assistant ("Thanks for the playlist suggestions, I'll give them a spin tonight"): its own
# words ("for the playlist suggestions") and a plan to take up what was suggested ("I'll give them a spin")
# are conversation; what else the sentence says is kept ("Thanks for asking, I moved to Leeds last week")
_THANKS = re.compile(
    r"^(?:(?:oh|ok|okay|great|aw+|ah|haha)\W*\s*)*(?:thanks|thank you|thank u|thx|ty|cheers)\b"
    r"(?: so much| a lot| again)? for\b",
    re.I,
)
_THANKED_FOR = re.compile(r"^for\b.*?(?:,\s*|\s+(?:and|but|so)\s+|$)", re.I)
_TAKES_IT_UP = re.compile(
    r"\b(?:I'll|I will|I'm going to|I am going to|gonna|I'd)\b.*\b(?:it|them|that|those|these)\b", re.I
)


def normalize(text: str) -> str:
    """Plain quotes and dashes, no emoji or emoticons, single spaces, chat spellings of "I" and of negations
    fixed."""
    text = _EMOJI.sub(" ", text.translate(_QUOTES))
    for pattern, replacement in _CHAT_SPELLINGS:
        text = pattern.sub(replacement, text)
    return text


def split_sentences(text: str) -> list[str]:
    """Sentences and lines, end punctuation kept; a period after "Dr" or "e.g" does not end one."""
    pieces = [p for p in _SENTENCE_END.split(text) if p and p.strip()]
    sentences: list[str] = []
    for piece in pieces:
        piece = _SPACES.sub(" ", piece).strip()
        if sentences and _ABBREVIATIONS.search(sentences[-1]):
            sentences[-1] = f"{sentences[-1]} {piece}"
        else:
            sentences.append(piece)
    return sentences


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
_FIRST_WORD = re.compile(r"^[A-Za-z']+(?= \w)")  # a word and then another: "Absolutely, ..." is not one


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
    m = _FIRST_WORD.match(core)
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


def subject_core(clause: str, dropped: bool = True) -> str | None:
    """The clause from its subject on (leading dates and adverbs stripped) when it states something of the
    user: "I ...", "my ...", "we ...", one of the few statements shaped otherwise ("call me Sam", "Berlin is
    home now"), or, with `dropped`, a chat clause whose subject was dropped, put back; else None."""
    core = strip_adverbials(clause)
    if _SUBJECT.match(core) or _ALSO_ABOUT_USER.match(core):
        return core
    return _restore_subject(core) if dropped else None


def is_first_person(clause: str, dropped: bool = False) -> bool:
    """Whether `subject_core` finds a statement of the user; an explicit subject only, unless `dropped`."""
    return subject_core(clause, dropped) is not None


# "My girlfriend" before "and I broke up" is a subject, not a statement: "my" and up to three words with no
# verb among them (one of these, or a word ending in "ed").
_VERBS = (
    r"is|are|was|were|has|have|had|do|does|did|got|gets|will|can|could|would|lives|works|loves|likes|hates|"
    r"goes|says|died|left|came|comes|plays|studies|teaches|makes|made|knows|thinks|wants|needs|runs|ran|"
    r"broke|became|becomes|turned|turns|went|sent|told|bought|gave|took|won|lost|just|also|still|never"
)
_MY_NOUN_ONLY = re.compile(rf"^(?:my|our)(?: (?!(?:{_VERBS})\b)[\w'-]+(?<!ed)(?<!'s)){{1,3}}$", re.I)


def is_statement(clause: str) -> bool:
    """A first-person clause that is a whole statement, not just a subject ("my sister", "me")."""
    core = strip_adverbials(strip_markers(clause))
    return is_first_person(core) and not _MY_NOUN_ONLY.match(core)


def _past_clause(text: str) -> bool:
    """A chat clause whose subject was dropped and whose verb is past tense: "moved to Antwerp"."""
    m = _FIRST_WORD.match(text.strip())
    if m is None:
        return False
    word = m.group(0).lower()
    return word in PAST_VERBS or (word.endswith("ed") and len(word) > 3 and word not in ED_NOT_PAST)


# the user as the subject, not "my parents": a dropped subject after it is the user's ("I packed and moved to Oslo";
# "My parents have left Madrid and retired to the coast" is the parents')
_SELF = re.compile(
    r"^(?:I|I'm|I've|I'd|we|we're|we've|we'd|me and|myself|(?-i:[A-Z])[a-z]+ and I|(?:my|our|the) [\w'-]+ and I)\b",
    re.I,
)
# a statement told as done, which may stand apart from a clause about something else before it ("Both kids are at
# school now so I've gone back to work"); not one in the present, whose date may be in that clause ("Our lease runs
# out next month so we're moving to Leeds")
_DONE = re.compile(
    rf"^(?:I|we)(?:'ve| have| had| (?:just |finally |already )?(?:\w+ed|{'|'.join(PAST_VERBS)}))\b|"
    # or a state a change leaves: "... and now I'm retired"
    r"^(?:I|we)(?:'m| am|'re| are) (?:now |officially |finally )?(?:retired|married|engaged|divorced|single|"
    r"unemployed|redundant|separated|widowed)\b",
    re.I,
)


# a clause that only leads into another ("Once it's sold and I've moved ...", "When the divorce is final and I'm
# single again, ..."): what follows it is not told as done
_SUBORDINATE = re.compile(
    r"^(?:once|when|whenever|as soon as|till|until|after|before|by the time|if|unless|while|since|because|as|"
    r"the moment|the day|hopefully|fingers crossed|with any luck|touch wood|if all goes well)\b",
    re.I,
)
# a short clause with a verb of being ("Season's over", "The lease was up"), not a subject ("The kids")
_SHORT_CLAUSE = re.compile(r"(?:\w's|\b(?:is|are|was|were))\s+\w", re.I)


def _other_clause(text: str) -> bool:
    """A whole clause about something else before a joined statement of the user ("Both kids are at school now
    so I've gone back to work", "Season's over and I've finished up"): no first-person subject, even a dropped
    one, and four words or more or a verb of being, so a subject shared with the user ("Tom and I", "The kids
    and I") is not one."""
    return (
        (len(text.split()) >= 4 or bool(_SHORT_CLAUSE.search(text)))
        and not _SUBORDINATE.match(strip_markers(text))
        and not is_first_person(strip_markers(text), dropped=True)
    )


_NOT_A_NAME = "|".join(
    [*MONTHS, *WEEKDAYS, "christmas", "easter", "covid", "uni", "university", "school", "college", "lockdown",
     "brexit", "diwali", "ramadan", "eid", "thanksgiving", "halloween", "hanukkah", "summer", "winter", "spring",
     "autumn", "work", "lunch", "dinner", "breakfast", "class", "church", "mass", "then", "that", "this"]
)  # fmt: skip
_PERSON = "|".join(
    sorted(
        {*RELATIVES, "missus", "hubby", "ex", "kids", "children", "parents", "folks", "family"},
        key=len,
        reverse=True,
    )
)
# a name or "my X" just after a clause opener, before "and I": the first half of a shared subject
_JOINT_AFTER_OPENER = re.compile(
    r"\b(?:since|when|after|before|because|until|till|as|that|where|while|once) "
    rf"(?:(?!(?:{_NOT_A_NAME})$)(?-i:[A-Z])[a-z]+|(?:my|our|the) (?:{_PERSON}))$",
    re.I,
)
_BARE_I = re.compile(r"I\b(?!')")


def _split_on(sentence: str, joiner: re.Pattern[str]) -> list[str]:
    """Split at each `joiner` whose both sides are first-person statements, or whose right side is a
    past-tense clause with its subject dropped ("I packed my bags and moved to Antwerp"), or a statement after
    such a clause ("Gave up the flat and I'm in Durban now"), or a statement told as done after a whole clause
    about something else (`_DONE`, `_other_clause`); at "so" only before a statement told as done, since the
    clause before it may hold the date ("My contract ends in March so I'm moving back"); never inside a subject
    shared with the user after a clause opener ("since Rob and I broke up"); other joins are kept."""
    parts: list[str] = []
    start = 0
    for m in joiner.finditer(sentence):
        left, right = sentence[start : m.start()], sentence[m.end() :]
        if _JOINT_AFTER_OPENER.search(left) and _BARE_I.match(right):
            continue  # "since Rob and I broke up": one subject, the user with someone, in a clause of its own
        done = bool(_DONE.match(strip_adverbials(right)))
        if m.group().strip(" ,").lower() == "so" and not done:
            continue
        if (
            (is_statement(right) or (_past_clause(right) and _SELF.match(strip_adverbials(left))))
            and is_statement(left)
        ) or (
            is_statement(right) and (_past_clause(strip_adverbials(left)) or (done and _other_clause(left)))
        ):
            parts.append(left)
            start = m.end()
    parts.append(sentence[start:])
    return [p.strip(" ,") for p in parts if p.strip(" ,")]


_AND_BUT = re.compile(r",?\s+(?:and|but|and then|but now|and now|and also|plus|so)\s+(?=\S)", re.I)
_COMMA = re.compile(r",\s+(?=\S)")
_BECAUSE = re.compile(r"(?:because|'?cause|cos|now that)\s+", re.I)  # not "since": mostly a time


# a clause with no verb but a participle saying a term of work or a stay is over, before a statement with its subject
# dropped: "Thirty years' service done, retired on the 14th", "Contract up, moved back to Leeds" (not "Season over",
# "Lease up": a pastime's or a stay's)
_FRAGMENT_DONE = re.compile(
    r"^(?!(?:I|we|my|our)\b)(?:[\w'-]+ ){0,4}(?:years?'?|months?'?|service|contract|notice|career|stint) "
    r"(?:done|over|finished|up|complete|completed|served|ended)$",
    re.I,
)


def _comma_split(sentence: str) -> list[str]:
    """Split at a comma followed by a first-person statement ("Loved it, I signed up ..."); the left part
    is kept as its own clause unless it is only a date or adverb leading into the subject."""
    parts: list[str] = []
    start = 0
    for m in _COMMA.finditer(sentence):
        left, right = sentence[start : m.start()], sentence[m.end() :]
        # "..., because we've moved up to Sapporo": the reason is a statement of its own
        reason = _BECAUSE.match(right)
        said = right[reason.end() :] if reason else ""
        if reason and _DONE.match(strip_adverbials(said)) and is_statement(said):
            parts.append(left)
            start = m.end() + reason.end()
            continue
        if _FRAGMENT_DONE.match(strip_markers(left)) and _past_clause(right):
            parts.append(left)  # "Thirty years' service done, retired on the 14th"
            start = m.end()
            continue
        if not is_first_person(strip_markers(right)):
            continue
        if not strip_adverbials(f"{strip_markers(left)}, ").strip():
            continue  # "On 2026-11-25, I ...", "After years in Lisbon, I ...": it belongs to the statement
        parts.append(left)
        start = m.end()
    parts.append(sentence[start:])
    return [p.strip(" ,") for p in parts if p.strip(" ,")]


# "No more X" kept as the user's given up only when theirs and not for a while: "No more sugar in my tea", "No more
# night patrols for me" (not "No more coffee for me today", "No more wine for me, I'm driving", "No more pizza left",
# "No more Netflix till exams are over", "No longer thirsty", "No longer on shift")
_NO_MORE = re.compile(r"^no (?:more|longer)\b", re.I)
_NO_MORE_KEPT = re.compile(
    r"^(?!.*\b(?:today|tonight|this (?:week|weekend|month|season|year)|till|until|for now|for a (?:while|bit|month|"
    r"week)|driving|early|left|thirsty|hungry|tired|stressed|sick|ill|on shift|from home|friends)\b)"
    r"(?:no more\b[^,]*\b(?:for me|in my \w+)\b|no longer (?:a |an )?(?:vegan|vegetarian|veggie|pescatarian|"
    r"teetotal|sober|single|married|engaged|smoking|drinking|eating|working (?:at|for|as)|with)\b)",
    re.I,
)


def _keep(clause: str) -> bool:
    if _NO_MORE.match(clause) and not _NO_MORE_KEPT.match(clause):
        return False
    core = subject_core(clause)
    if core is None:
        return False
    lowered = core.lower().rstrip(".!? ")
    if len(lowered.split()) < 2 and not _ALSO_ABOUT_USER.match(core):  # "I Quit" is two
        return False
    if (
        lowered in FILLER_CLAUSES
        or _PRONOUN_REACTION.match(lowered)
        or _META.match(core)
        or _PASSING.match(core)
    ):
        return False
    if _REQUEST.match(core) or _HEDGE.match(core):
        return False
    if _ABOUT_ASSISTANT.search(core) and not _ALSO_ABOUT_USER.match(core):
        return False
    return True


def statements(text: str) -> list[Clause]:
    """The first-person statements in one user message, in order, as said (markers and end punctuation
    stripped). Questions, requests, greetings, filler, hedged or hypothetical sentences and statements
    about the assistant are dropped; "and"/"but"/comma joins of two full statements become two."""
    kept: list[Clause] = []
    for sentence in split_sentences(normalize(text)):
        if _HYPOTHETICAL.search(sentence):
            continue
        thanked = bool(_THANKS.match(sentence))
        correction = bool(_CORRECTION.match(sentence))
        sentence = _TRAILING_FILLER.sub("", sentence)
        question = sentence.rstrip().endswith("?")
        body = strip_markers(sentence.rstrip(" .!?"))
        if question:
            # "I just adopted a cat, any name ideas?": the part after the last comma is the question
            pieces = _comma_split(body.rsplit(",", 1)[0]) if "," in body else []
        else:
            pieces = _comma_split(body)
        if _NO_MORE.match(body) and not _NO_MORE_KEPT.match(body):  # the whole sentence: "..., I'm driving"
            pieces = [p for p in pieces if not _NO_MORE.match(strip_markers(p))]
        for piece in pieces:
            piece = strip_markers(piece)
            if _QUESTION_START.match(piece) and not is_first_person(piece, dropped=True):
                continue  # "Do you ...", "How do I ..." (but "When I was a kid, I ..." is a statement)
            for clause in _split_on(piece, _AND_BUT):
                clause = strip_markers(clause).rstrip(" .!?,")
                if thanked:
                    clause = _THANKED_FOR.sub("", clause)
                    if _TAKES_IT_UP.search(clause):
                        continue
                if clause and _keep(clause):
                    kept.append(Clause(clause, correction))
    return kept

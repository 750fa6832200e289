"""A user's message cut into candidate statements: sentences, then clauses joined by "and"/"but" or a comma
where each side is a full first-person statement; then the ones that are not memory are dropped (greetings,
questions, requests, filler, hedged hypotheticals, statements about the assistant). A chat clause whose
subject was dropped ("Moved to Oslo last month") counts as the user's; `clause_subject.subject_core` puts the "I" back.

Knows nothing of dates, slots or facts: it returns the kept clauses as said, minus discourse markers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvmem.formation.clause_subject import (
    ALSO_ABOUT_USER,
    FIRST_WORD,
    is_first_person,
    strip_adverbials,
    strip_markers,
    subject_core,
)
from kvmem.formation.dates import MONTHS, WEEKDAYS
from kvmem.formation.lexicon import (
    ED_NOT_PAST,
    FILLER_CLAUSES,
    PAST_VERBS,
    RELATIVES,
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
    # "jus quit lidl" (not "where to put his jus": the sauce)
    (
        re.compile(
            r"(?:(?<=^)|(?<=[.!?] )|(?<=\bI ))jus(?= (?:quit|left|got|moved|started|finished|broke|bought|sold|had|"
            r"been|split|found|joined|signed|landed|retired|resigned|handed|packed|lost|passed|booked|won)\b)",
            re.I,
        ),
        "just",
    ),
    (re.compile(r"(?<=[a-z]) n (?=[a-z])"), " and "),  # "me n my gf", "work n sleep"
)

_ABBREVIATIONS = re.compile(r"(?:\b(?:dr|mr|mrs|ms|st|prof|jr|sr|vs|etc|approx|no)|\b(?:e\.g|i\.e))\.$", re.I)
# ... and a laugh typed mid-message, where chat puts no full stop ("I dont remember lol but i work in a clinic")
_SENTENCE_END = re.compile(
    r"(?<=[.!?])\s+|\s*\n+\s*|\s*;\s*|\s+-\s+|:\s+|\s+(?:lol|lmao|haha+|hehe)[.!]*\s+(?=\w)(?!at\b|about\b)",
    re.I,
)

_CORRECTION = re.compile(r"^(?:actually|correction|sorry|no wait|wait|oops)\b", re.I)
_TRAILING_FILLER = re.compile(
    # ("My mum is okay" keeps its "okay")
    r"(?:[,\s]+(?:you know|you see|lol|haha+|hehe|honestly|actually|though|right|(?<!\bis )(?<!'s )(?:ok|okay)|btw|"
    r"by the way)|"
    r",\s*just like that)+\s*[.!?]*$",
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
    m = FIRST_WORD.match(text.strip())
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
    if len(lowered.split()) < 2 and not ALSO_ABOUT_USER.match(core):  # "I Quit" is two
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
    if _ABOUT_ASSISTANT.search(core) and not ALSO_ABOUT_USER.match(core):
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

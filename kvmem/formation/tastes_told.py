"""What tells a taste or a habit of the user's (part of the guard's reading, `change_guard.py`): a taste told as one
("I love olives now", "I'm into bouldering"), a habit taken up ("I journal every night now"), one told against another
or given up ("I swim instead of running now", "I don't do fry-ups anymore"), a taste told as not the user's ("I've
never kept a diary"), and whether two statements share a word. What lets the change head's pair layer and the pair
encoder weigh a fact against a memory of a taste (`readings.py`).
"""

from __future__ import annotations

import re

from kvmem.formation.lexicon import STOP_WORDS

# what a habit told now is not: a duty done for someone or because of something ("I now cook every night because my
# wife is ill", "I visit my dad every day in hospital"), chores and care, or what befalls one ("I get a migraine
# every day now", "These days I cry every night")
_NOT_A_HABIT = (
    r"(?!.*\b(?:because|cos|since (?:my|the|his|her|our)|as (?:my|the)|for (?:my|the|his|her|our|a|an)|with the "
    r"(?:baby|kids?|puppy|dog)|in hospital|(?:have|has|had) to|clean\w*|cook\w*|visit\w*|wake|waking|woke|cry|"
    r"crying|get an? \w+|migraines?|headaches?|pain|hoover\w*|iron\w*|wash\w*|feed\w*|drop\w* (?:off|the)|pick\w* up|"
    r"school run|nappies|night feeds?|shifts?|overtime|commute\w*)\b)"
)
# a taste told by the user as theirs: "I (really, now, ...) love / like / hate ...", "I'm into / a fan of ...",
# "X is my favourite"; not a word that only sounds like one ("like my dad", "moved into", "a fan of my work",
# "my favourite shop", "they love them")
_TASTE = re.compile(
    r"\bI(?:'m| am)?(?: (?:really|truly|actually|now|just|still|totally|kind of|do|don't|do not|no longer|\w+ly))? "
    r"(?:love|like|enjoy|hate|prefer|adore|can't stand|cannot stand|can't get enough of|can't face)\b"
    r"|\bI(?:'m| am)(?: (?:now|really|totally|completely|so|\w+ly))? (?:into|a (?:big |huge )?fan of|fond of|hooked|"
    r"obsessed with|addicted to|over)\b"
    r"|\bI(?:'m| am)(?: (?:now|\w+ly))? an? (?:[\w-]+ )?(?:person|fan|lover|convert|addict)\b"
    r"|\bI(?:'ve| have)(?: \w+ly)? (?:gone full|turned into an?|got into|gotten into|come round to|come around to|"
    r"fallen in love with)\b"
    r"|\b(?:is|are) (?:now )?my (?:new )?favou?rite\b",
    re.I,
)
# a habit taken up, held now: "I journal every night now", "these days I swim every morning" (not "I worked every day",
# nor a duty or what befalls one: _NOT_A_HABIT)
_NEW_HABIT = re.compile(
    rf"^{_NOT_A_HABIT}(?=.*\b(?:now|these days|nowadays)\b)(?:(?:now|these days|nowadays),? )?I (?:now |\w+ly )?"
    r"(?!(?:am|was|were|have|had|will|would|can|could|did|went|got|used)\b)[a-z]+ (?:[\w'-]+ ){0,4}?every (?:single )?"
    r"(?:day|night|morning|evening|week|weekend|(?:mon|tues|wednes|thurs|fri|satur|sun)day)\b",
    re.I,
)
# a taste or habit told as not the user's: "I've never kept a diary", "I hate exercise", "I can't stand olives"
_NOT_MINE = re.compile(
    r"\b(?:never|not|no|hate|hated|dislike|can't stand|cannot stand|can't bear)\b|n't\b", re.I
)


def tells_new_habit(clause: str) -> bool:
    """Whether the clause tells a habit held now ("I journal every night now"): one taken up, so it weighs against a
    taste told as not the user's (`tells_not_mine`: "I've never kept a diary"), not against one it may go with ("I
    bake sourdough every weekend now" and "I love baking")."""
    return bool(_NEW_HABIT.search(clause))


def tells_not_mine(memory: str) -> bool:
    """Whether a memory tells a taste or habit as not the user's ("I've never kept a diary", "I hate exercise")."""
    return bool(_NOT_MINE.search(memory))


# a habit of the user's told as how things are now, in the simple present: "I swim instead of running now", "I paint
# exclusively in watercolour now", "I don't do fry-ups anymore", "Nowadays I mostly listen to classical" (not "I'm
# cooking mushrooms for the kids now", "I went there now", "I think so now", "I can do it now")
_HABIT_NOW = re.compile(
    # told against another ("instead of", "exclusively", "only") or as given up ("don't ... anymore"): not a habit
    # that may go with the taste ("I do parkrun most Saturdays now" and "I love running")
    r"^(?=.*\b(?:instead|exclusively|only|any ?more|no longer|don't|do not|never)\b)"
    rf"{_NOT_A_HABIT}(?=.*\b(?:now|these days|nowadays|any ?more|no longer)\b)(?:(?:now|these days|nowadays),? )?I "
    r"(?:(?:\w+ly|now|only|mostly|just|still|even) )?(?:(?:don't|do not|no longer|never) )?"
    r"(?!(?:am|was|were|had|did|went|got|will|would|could|should|might|can|can't|cannot|must|need|want|think|guess|"
    r"feel|hope|wish|mean|know|see|say|said|suppose|reckon|believe|miss|remember|forget|have to|has to)\b)"
    r"[a-z]+(?<!ing)(?<!ed)\b(?!')",
    re.I,
)


def tells_habit_now(clause: str) -> bool:
    """Whether the clause tells a habit of the user's as it is now, in the simple present, against another or given
    up ("I paint exclusively in watercolour now", "I don't do fry-ups anymore"): with a close memory of a taste
    that shares a word with it (`shares_a_word`), what the pair encoder may read as one given up or taken up."""
    return bool(_HABIT_NOW.search(clause))


_SUFFIX = re.compile(r"(?:ning|ing|ed|es|s)$")


def _stems(text: str) -> set[str]:
    return {_SUFFIX.sub("", w)[:4] for w in re.findall(r"[a-z]{3,}", text.lower()) if w not in STOP_WORDS}


def shares_a_word(text: str, other: str) -> bool:
    """Whether two statements share a content word, roughly stemmed ("I swim instead of running now" and "I run on
    the treadmill", "I don't do fry-ups anymore" and "I love a big fry-up")."""
    return bool(_stems(text) & _stems(other))


def tells_taste(clause: str) -> bool:
    """Whether the clause tells a taste of the user's as one ("Weirdly I love olives now", "Mushrooms are my
    favourite thing now", "I'm into bouldering"), not only names a thing ("I cooked mushrooms for the kids, like
    every Sunday") or another's taste ("they love them")."""
    return bool(_TASTE.search(clause))

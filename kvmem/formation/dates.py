"""Relative dates in a turn's text, resolved against the turn's own chat_time ("yesterday" -> "on 2026-11-25").

Owns the phrase table and the rewrite; a pure function of (text, chat_time), never the wall clock. Knows
nothing of facts or slots: the extractor decides what a resolved date means for `valid_from`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import date, datetime, timedelta, timezone

from kvmem.utc import utc_text

WEEKDAYS = ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday")
MONTHS = (
    "january",
    "february",
    "march",
    "april",
    "may",
    "june",
    "july",
    "august",
    "september",
    "october",
    "november",
    "december",
)
_NUMBERS = {
    "a": 1,
    "an": 1,
    "one": 1,
    "a couple of": 2,
    "two": 2,
    "three": 3,
    "four": 4,
    "five": 5,
    "six": 6,
    "seven": 7,
    "eight": 8,
    "nine": 9,
    "ten": 10,
    "eleven": 11,
    "twelve": 12,
}
# A resolved phrase after one of these loses its own preposition: "since last week" -> "since the week of ..."
_PREPOSITIONS = {"since", "from", "until", "till", "by", "before", "after", "of", "around", "during"}


@dataclass(frozen=True)
class ResolvedDate:
    """One relative phrase found in the text: what it said, what replaced it, and the days it names."""

    phrase: str  # as written: "last week"
    replacement: str  # as rewritten: "in the week of 2026-11-16"
    start: date  # first day it names
    end: date  # last day it names (== start for a single day)


@dataclass(frozen=True)
class DateResolution:
    """The text with every relative phrase rewritten, and the phrases found, in text order."""

    text: str
    dates: tuple[ResolvedDate, ...]

    @property
    def event_date(self) -> date | None:
        """The first day named by the first phrase, or None where the text names no relative date."""
        return self.dates[0].start if self.dates else None


def parse_chat_time(value: str) -> datetime:
    """An ISO 8601 time ("2026-11-26T14:41:09.000000Z", "2026-11-26T14:41:09+00:00" or "2026-11-26") as an
    aware UTC datetime; a time without a zone is taken as UTC."""
    text = value.strip()
    if text.endswith(("Z", "z")):
        text = text[:-1] + "+00:00"
    try:
        parsed = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"chat_time: not an ISO 8601 time: {value!r}") from None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=timezone.utc)
    return parsed.astimezone(timezone.utc)


def iso_time(moment: datetime | date) -> str:
    """The log's time format, "2026-11-26T14:41:09.000000Z"; a date is its midnight UTC."""
    if not isinstance(moment, datetime):
        moment = datetime(moment.year, moment.month, moment.day, tzinfo=timezone.utc)
    return utc_text(moment)


# ---- calendar arithmetic -------------------------------------------------------------------------------


def _monday(day: date) -> date:
    return day - timedelta(days=day.weekday())


def _add_months(day: date, months: int) -> date:
    """The first day of the month `months` after `day`'s month."""
    index = day.year * 12 + day.month - 1 + months
    return date(index // 12, index % 12 + 1, 1)


def _month_end(first: date) -> date:
    return _add_months(first, 1) - timedelta(days=1)


def _on(day: date, part: str | None = None) -> tuple[str, date, date]:
    text = f"on the {part} of {day.isoformat()}" if part else f"on {day.isoformat()}"
    return text, day, day


def _week(monday: date) -> tuple[str, date, date]:
    return f"in the week of {monday.isoformat()}", monday, monday + timedelta(days=6)


def _month(first: date) -> tuple[str, date, date]:
    return f"in {MONTHS[first.month - 1].capitalize()} {first.year}", first, _month_end(first)


def _year(year: int) -> tuple[str, date, date]:
    return f"in {year}", date(year, 1, 1), date(year, 12, 31)


def _shift(today: date, unit: str, n: int) -> tuple[str, date, date]:
    """`n` units from today (negative: ago), named at the unit's own grain."""
    unit = unit.rstrip("s")
    if unit == "day":
        return _on(today + timedelta(days=n))
    if unit == "week":
        return _week(_monday(today + timedelta(weeks=n)))
    if unit == "month":
        return _month(_add_months(today, n))
    assert unit == "year", unit
    return _year(today.year + n)


# ---- tense: decides "on Friday" (past: the last one; otherwise the next one) ------------------------------

_FUTURE = re.compile(
    r"\b(?:will|won't|shall|gonna|going to|plan(?:ning)? to|about to|'ll|tomorrow|next)\b|"
    r"\b(?:i'm|i am|we're|we are|he's|she's|they're)\s+\w+ing\b",
    re.IGNORECASE,
)
_PAST = re.compile(
    r"\b(?:was|were|did|didn't|had|went|got|saw|met|came|left|took|made|ate|drank|bought|began|found|"
    r"gave|told|said|felt|ran|won|lost|sold|spent|paid|read|wrote|broke|flew|drove|caught|thought|kept|"
    r"brought|heard|sent|sat|slept|swam|threw|woke|wore|yesterday|ago|last)\b|\b\w{2,}ed\b",
    re.IGNORECASE,
)
_NOT_PAST_ED = {"need", "needed", "married", "interested", "excited", "tired", "based", "called", "named"}


def is_past_tense(text: str) -> bool:
    """Whether the text reads as past tense: a future marker wins, then a past verb or past adverb."""
    if _FUTURE.search(text):
        return False
    return any(m.group(0).lower() not in _NOT_PAST_ED for m in _PAST.finditer(text))


# ---- the phrase table: (regex, handler(match, today, past) -> (replacement, start, end)) -----------------

_NUM = "|".join(sorted((re.escape(k) for k in _NUMBERS), key=len, reverse=True))
_DAY = "|".join(WEEKDAYS)
_PART = r"morning|afternoon|evening|night"

Handler = Callable[[re.Match[str], date, bool], tuple[str, date, date]]


def _weekday_named(m: re.Match[str], today: date, past: bool) -> tuple[str, date, date]:
    """ "last X": the most recent X before today; "this X": X of this Monday-Sunday week; "next X": X of next
    week; "on X": the most recent X before today in a past-tense text, else the next X after today."""
    which, name = (m.group("which") or "on").lower(), m.group("wday").lower()
    part = (m.group("wpart") or "").lower() or None  # "on Sunday evening": that evening
    target = WEEKDAYS.index(name)
    if which == "this":
        return _on(_monday(today) + timedelta(days=target), part)
    if which == "next":
        return _on(_monday(today) + timedelta(days=7 + target), part)
    if which == "last" or past:
        back = (today.weekday() - target) % 7 or 7
        return _on(today - timedelta(days=back), part)
    ahead = (target - today.weekday()) % 7 or 7
    return _on(today + timedelta(days=ahead), part)


def _weekend(m: re.Match[str], today: date, past: bool) -> tuple[str, date, date]:
    """ "last weekend": the Saturday-Sunday before this Monday-Sunday week; "this weekend": this week's; "next
    weekend": next week's."""
    saturday = _monday(today) + timedelta(days=5 + 7 * _which_offset(m))
    return f"on the weekend of {saturday.isoformat()}", saturday, saturday + timedelta(days=1)


def _which_offset(m: re.Match[str]) -> int:
    return {"last": -1, "this": 0, "next": 1}[m.group("which").lower()]


_PATTERNS: tuple[tuple[str, Handler], ...] = (
    (r"the day before yesterday", lambda m, t, p: _on(t - timedelta(days=2))),
    (r"the day after tomorrow", lambda m, t, p: _on(t + timedelta(days=2))),
    (rf"yesterday (?P<ypart>{_PART})", lambda m, t, p: _on(t - timedelta(days=1), m.group("ypart").lower())),
    (r"last night", lambda m, t, p: _on(t - timedelta(days=1), "night")),
    (r"yesterday", lambda m, t, p: _on(t - timedelta(days=1))),
    (r"this (?P<tpart>morning|afternoon|evening)", lambda m, t, p: _on(t, m.group("tpart").lower())),
    (r"tonight", lambda m, t, p: _on(t, "night")),
    (r"today", lambda m, t, p: _on(t)),
    (rf"tomorrow (?P<mpart>{_PART})", lambda m, t, p: _on(t + timedelta(days=1), m.group("mpart").lower())),
    (r"tomorrow", lambda m, t, p: _on(t + timedelta(days=1))),
    (r"(?P<which>last|this|next) weekend", _weekend),
    (
        r"(?P<which>last|this|next) week",
        lambda m, t, p: _week(_monday(t) + timedelta(weeks=_which_offset(m))),
    ),
    (r"(?P<which>last|this|next) month", lambda m, t, p: _month(_add_months(t, _which_offset(m)))),
    (r"(?P<which>last|this|next) year", lambda m, t, p: _year(t.year + _which_offset(m))),
    (
        rf"(?P<agon>\d{{1,3}}|{_NUM}) (?P<agou>days?|weeks?|months?|years?) ago",
        lambda m, t, p: _shift(t, m.group("agou").lower(), -_count(m.group("agon"))),
    ),
    (
        rf"in (?P<inn>\d{{1,3}}|{_NUM}) (?P<inu>days?|weeks?|months?|years?)",
        lambda m, t, p: _shift(t, m.group("inu").lower(), _count(m.group("inn"))),
    ),
    # "on Sunday evening" names the evening; "on Sunday evenings" is a habit, left alone like "on Sundays"
    (
        rf"(?:(?P<which>last|this|next)|on) (?P<wday>{_DAY})(?: (?P<wpart>{_PART}))?(?! (?:{_PART})s\b)",
        _weekday_named,
    ),
)


def _count(word: str) -> int:
    return int(word) if word.isdigit() else _NUMBERS[word.lower()]


_COMPILED = tuple(re.compile(pattern, re.IGNORECASE) for pattern, _ in _PATTERNS)
# One alternation, earlier entries first, so "yesterday morning" wins over "yesterday"; it only finds the span
# and which entry matched (the entries reuse group names, so each is matched again alone for its groups). A
# phrase directly followed by "s" or "'s" ("on Mondays", "last week's") is a habit or a possessive, left alone.
_UNNAMED = tuple(re.sub(r"\(\?P<\w+>", "(?:", pattern) for pattern, _ in _PATTERNS)
_MASTER = re.compile(
    "|".join(rf"(?P<p{i}>\b(?:{pattern})\b(?!'?s\b))" for i, pattern in enumerate(_UNNAMED)), re.IGNORECASE
)
# a negation before "in N weeks" in its clause makes it a span up to now ("haven't touched Coke in a month", "not had
# a drink in two weeks"), not a date ahead
_NEGATED = re.compile(r"n't\b|\b(?:not|never)\b", re.IGNORECASE)
# "last/next week" after "the" or before "of" names a part of another span ("the last week of February", "the
# next month or so", "last week of term"), not one counted from today
_ORDINAL_WHICH = re.compile(r"(?:last|this|next) ", re.IGNORECASE)
_OF_AFTER = re.compile(
    r"\s+of\s+(?:the\s+)?(?:"
    + "|".join(MONTHS)
    + r"|term|semester|month|year|season|summer|winter|spring|autumn|"
    r"fall|holidays?|school|uni|university|college|trip|tour|contract|training)\b",
    re.IGNORECASE,
)
# Any one relative phrase, unresolved, for callers that only need to skip over one ("Yesterday, I ...").
RELATIVE_DATE = re.compile("|".join(rf"(?:{pattern})" for pattern in _UNNAMED), re.IGNORECASE)


def resolve_dates(text: str, chat_time: str | datetime) -> DateResolution:
    """Rewrite each relative date phrase in `text` as an absolute one, counted from `chat_time`'s UTC day.

    Resolved: yesterday/today/tonight/tomorrow (with morning/afternoon/evening/night), the day before
    yesterday / after tomorrow, last night, this morning/afternoon/evening, last/this/next week, weekend,
    month and year, "N days/weeks/months/years ago", "in N days/weeks/months/years" (not after a negation in its
    clause: "haven't smoked in a month" is a span up to now), "last/this/next
    <weekday>" and "on <weekday>" (see `_weekday_named`). Days read "on 2026-11-25", weeks "in the week of
    <its Monday>", months "in October 2026", years "in 2025". Tense for "on <weekday>" is judged over the
    whole `text`, so callers pass one clause. Bare month names ("in May") are left as written.
    """
    now = chat_time if isinstance(chat_time, datetime) else parse_chat_time(chat_time)
    today = now.astimezone(timezone.utc).date()
    past = is_past_tense(text)
    found: list[ResolvedDate] = []

    def replace(m: re.Match[str]) -> str:
        index = int(m.lastgroup[1:])  # type: ignore[index]
        groups = _COMPILED[index].fullmatch(m.group(0))
        assert groups is not None, m.group(0)
        if "?P<inn>" in _PATTERNS[index][0] and _NEGATED.search(re.split(r"[,.;!?]", text[: m.start()])[-1]):
            return m.group(0)  # "I haven't smoked in a month": a span of time so far, not a date ahead
        before = text[: m.start()].rstrip()
        previous = before.rsplit(None, 1)[-1].lower() if before else ""
        if _ORDINAL_WHICH.match(m.group(0)) and (previous == "the" or _OF_AFTER.match(text, m.end())):
            return m.group(0)  # "the last week of February", "last week of term": a part of a named span
        replacement, start, end = _PATTERNS[index][1](groups, today, past)
        if previous in _PREPOSITIONS or (previous == "on" and replacement.startswith("on ")):
            replacement = replacement.split(" ", 1)[1]
        if m.group(0)[0].isupper() and (not before or before[-1] in ".!?"):
            replacement = replacement[0].upper() + replacement[1:]
        found.append(ResolvedDate(m.group(0), replacement, start, end))
        return replacement

    rewritten = _MASTER.sub(replace, text)
    return DateResolution(rewritten, tuple(found))

"""Time expressions in a search query ("yesterday", "last week", "in May", "29 Dec 2023", "spring of 2024").

Owns turning the English time words of a query into an inclusive chat_time range, relative to a reference
moment (the store's clock when the query is asked), and saying which words of the query they were. A general parser: absolute dates in the
common orders, months, years, seasons (northern hemisphere, winter = Dec-Feb), and relative days, weeks,
months and years. Several expressions: the range spanning them all. Knows nothing of the store.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import date, datetime, time, timedelta, timezone

from kvmem.utc import utc_text

_MONTHS = {
    name: i + 1
    for i, names in enumerate(
        (
            ("january", "jan"),
            ("february", "feb"),
            ("march", "mar"),
            ("april", "apr"),
            ("may",),
            ("june", "jun"),
            ("july", "jul"),
            ("august", "aug"),
            ("september", "sep", "sept"),
            ("october", "oct"),
            ("november", "nov"),
            ("december", "dec"),
        )
    )
    for name in names
}
_WEEKDAYS = ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday")
_SEASONS = {"spring": (3, 5), "summer": (6, 8), "autumn": (9, 11), "fall": (9, 11), "winter": (12, 2)}
_UNITS = {"day": 1, "week": 7, "month": 30, "year": 365}
_NUMBERS = {"a": 1, "an": 1, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "few": 3}

_M = r"(?P<month>" + "|".join(sorted(_MONTHS, key=len, reverse=True)) + r")\.?"
_D = r"(?P<day>[0-3]?\d)(?:st|nd|rd|th)?"
_Y = r"(?P<year>(?:19|20)\d\d)"
_PATTERNS: tuple[tuple[str, re.Pattern], ...] = tuple(
    (kind, re.compile(pattern, re.IGNORECASE))
    for kind, pattern in (
        ("iso", r"\b" + _Y + r"-(?P<month>[01]?\d)-(?P<day>[0-3]?\d)\b"),
        (
            "week_of",
            r"\b(?P<nth>first|second|third|fourth|last)\s+week\s+of\s+(?:" + _M + r"\s+)?" + _Y + r"\b",
        ),
        ("dmy", r"\b" + _D + r"\s+(?:of\s+)?" + _M + r",?\s+" + _Y + r"\b"),
        ("mdy", r"\b" + _M + r"\s+" + _D + r",?\s+" + _Y + r"\b"),
        ("dm", r"\b" + _D + r"\s+(?:of\s+)?" + _M + r"\b"),
        ("md", r"\b" + _M + r"\s+" + _D + r"\b(?!\s*(?:[:.]|am\b|pm\b))"),
        ("my", r"\b" + _M + r",?\s+(?:of\s+)?" + _Y + r"\b"),
        (
            "season",
            r"\b(?P<season>spring|summer|autumn|fall|winter)\s+(?:of\s+)?"
            + _Y
            + r"(?:\s*[-/–]\s*(?P<year2>(?:19|20)\d\d))?\b",
        ),
        ("in_month", r"\b(?:in|during|since|early|late|mid|last|this)\s+" + _M + r"\b"),
        ("in_year", r"\b(?:in|during|since|of|year)\s+" + _Y + r"\b"),
        (
            "ago",
            r"\b(?P<count>\d+|a|an|one|two|three|four|five|six|few)\s+(?P<unit>day|week|month|year)s?\s+ago\b",
        ),
        ("last_unit", r"\b(?P<which>last|this|past|previous)\s+(?P<unit>week|month|year|weekend)\b"),
        ("weekday", r"\b(?:last|on|this|past)\s+(?P<weekday>" + "|".join(_WEEKDAYS) + r")\b"),
        ("day_word", r"\b(?P<word>today|tonight|yesterday|last night|this morning|day before yesterday)\b"),
    )
)


_FORMAT = "%Y-%m-%dT%H:%M:%S.%fZ"
_ABSOLUTE = ("iso", "week_of", "dmy", "mdy", "my", "season", "in_year")


@dataclass(frozen=True)
class QueryTime:
    """Inclusive chat_time bounds in the store's UTC format, and the character spans of the time words
    (they stay in the keyword query: "New Year 2024" is also what was said)."""

    start: str
    end: str
    spans: tuple[tuple[int, int], ...]

    def later_by(self, days: int) -> QueryTime:
        """The same range with its end `days` later (what happened on a day is often told the next)."""
        end = datetime.strptime(self.end, _FORMAT).replace(tzinfo=timezone.utc) + timedelta(days=days)
        return QueryTime(self.start, utc_text(end), self.spans)


def _day(d: date) -> tuple[date, date]:
    return d, d


def _month(year: int, month: int) -> tuple[date, date]:
    first = date(year, month, 1)
    following = date(year + (month == 12), month % 12 + 1, 1)
    return first, following - timedelta(days=1)


def _safe_date(year: int, month: int, day: int) -> date | None:
    try:
        return date(year, month, day)
    except ValueError:
        return None


def _recent(today: date, month: int, day: int | None) -> tuple[date, date] | None:
    """The latest such day (or month) not after today."""
    year = today.year
    if day is None:
        start, end = _month(year, month)
        return _month(year - 1, month) if start > today else (start, end)
    found = _safe_date(year, month, day)
    if found is None:
        return None
    if found > today:
        found = _safe_date(year - 1, month, day)
    return None if found is None else _day(found)


def _range(kind: str, m: re.Match, original: str, today_of: Callable[[], date]) -> tuple[date, date] | None:
    g = m.groupdict()
    if kind not in _ABSOLUTE:
        today = today_of()
    month = _MONTHS.get((g.get("month") or "").lower()) if g.get("month") else None
    if kind == "iso":
        found = _safe_date(int(g["year"]), int(g["month"]), int(g["day"]))
        return None if found is None else _day(found)
    if kind == "week_of":
        year = int(g["year"])
        first, last = _month(year, month) if month else (date(year, 1, 1), date(year, 12, 31))
        nth = g["nth"].lower()
        if nth == "last":
            return last - timedelta(days=6), last
        start = first + timedelta(days=7 * ("first", "second", "third", "fourth").index(nth))
        return start, start + timedelta(days=6)
    if kind in ("dmy", "mdy"):
        found = _safe_date(int(g["year"]), month, int(g["day"]))
        return None if found is None else _day(found)
    if kind in ("dm", "md", "in_month") and (g.get("month") or "").lower() == "may":
        if original[m.start("month")] != "M":  # "may" the verb, not the month
            return None
    if kind in ("dm", "md"):
        return _recent(today, month, int(g["day"]))
    if kind == "my":
        return _month(int(g["year"]), month)
    if kind == "in_month":
        return _recent(today, month, None)
    if kind == "season":
        first, last = _SEASONS[g["season"].lower()]
        year = int(g["year"])
        if first > last:  # winter: December of the year, into the next (or the given second year)
            end_year = int(g["year2"]) if g.get("year2") else year + 1
            return date(year, 12, 1), _month(end_year, last)[1]
        return date(year, first, 1), _month(int(g["year2"] or year), last)[1]
    if kind == "in_year":
        return date(int(g["year"]), 1, 1), date(int(g["year"]), 12, 31)
    if kind == "ago":
        count = g["count"].lower()
        n = int(count) if count.isdigit() else _NUMBERS[count]
        days = n * _UNITS[g["unit"].lower()]
        span = {"day": 0, "week": 3, "month": 15, "year": 182}[g["unit"].lower()]
        center = today - timedelta(days=days)
        return center - timedelta(days=span), min(today, center + timedelta(days=span))
    if kind == "last_unit":
        unit, which = g["unit"].lower(), g["which"].lower()
        this = which == "this"
        if unit in ("week", "weekend"):
            monday = today - timedelta(days=today.weekday())
            start = monday if this else monday - timedelta(days=7)
            if unit == "weekend":
                return start + timedelta(days=5), start + timedelta(days=6)
            return start, min(today, start + timedelta(days=6)) if this else start + timedelta(days=6)
        if unit == "month":
            if this:
                return date(today.year, today.month, 1), today
            return _month(today.year - (today.month == 1), (today.month - 2) % 12 + 1)
        year = today.year if this else today.year - 1
        return date(year, 1, 1), today if this else date(year, 12, 31)
    if kind == "weekday":
        back = (today.weekday() - _WEEKDAYS.index(g["weekday"].lower())) % 7
        return _day(today - timedelta(days=back or (7 if m.group(0).lower().startswith("last") else 0)))
    word = g["word"].lower()
    back = {"yesterday": 1, "last night": 1, "day before yesterday": 2}.get(word, 0)
    return _day(today - timedelta(days=back))


class _Today:
    """Today's UTC date from a clock, read once and only when an expression needs it."""

    def __init__(self, clock: Callable[[], datetime]) -> None:
        self._clock, self._today = clock, None

    def __call__(self) -> date:
        if self._today is None:
            now = self._clock()
            self._today = (
                (now if now.tzinfo else now.replace(tzinfo=timezone.utc)).astimezone(timezone.utc).date()
            )
        return self._today


def parse_query_time(query: str, clock: Callable[[], datetime]) -> QueryTime | None:
    """The chat_time range the query's time words name, relative to `clock()` (read only when a relative
    expression needs it); None when it names none."""
    today = _Today(clock)
    taken: list[tuple[int, int]] = []
    ranges: list[tuple[date, date]] = []
    for kind, pattern in _PATTERNS:  # most specific first; a span taken by one is not parsed again
        for m in pattern.finditer(query):
            if any(a < m.end() and m.start() < b for a, b in taken):
                continue
            found = _range(kind, m, query, today)
            if found is not None:
                taken.append((m.start(), m.end()))
                ranges.append(found)
    if not ranges:
        return None
    start = datetime.combine(min(r[0] for r in ranges), time.min, timezone.utc)
    end = datetime.combine(max(r[1] for r in ranges), time.max, timezone.utc)
    return QueryTime(utc_text(start), utc_text(end), tuple(sorted(taken)))

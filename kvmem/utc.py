"""The one text form of a moment everywhere a time is stored or compared: "2026-11-26T14:41:09.000000Z".

Fixed width (the year zero-padded to four digits: strftime's %Y is not on glibc, and "999-..." sorts after
"2026-..."), so the store's time filters may compare these strings as text.
"""

from __future__ import annotations

from datetime import datetime, timezone


def utc_text(moment: datetime) -> str:
    """`moment` in UTC as fixed-width text; a naive datetime is taken as UTC. OverflowError when the moment
    leaves datetime's range once in UTC (year 1 with a positive offset, year 9999 with a negative one)."""
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    u = moment.astimezone(timezone.utc)
    return (
        f"{u.year:04d}-{u.month:02d}-{u.day:02d}T{u.hour:02d}:{u.minute:02d}:{u.second:02d}."
        f"{u.microsecond:06d}Z"
    )

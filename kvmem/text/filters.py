"""Input validation for the plaintext store: ids, texts, tags, metadata, times, add items and filters.

Owns what counts as well-formed input and how a filter becomes a SQL WHERE fragment; every refusal is an
InvalidMemoryInput naming the field. Knows nothing of connections or transactions.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, NamedTuple

from kvmem.text.db.dialect import SQLITE, Dialect
from kvmem.text.errors import InvalidMemoryInput
from kvmem.utc import utc_text

_TOKEN_RE = re.compile(r"\w+|[^\w\s]", re.UNICODE)
_FILTER_KEYS = ("session_id", "agent_id", "role", "tags", "metadata", "time_range")
_SCALARS = (str, int, float, bool, type(None))
_MESSAGE_KEYS = ("role", "content", "chat_time")
TURN_MESSAGE_KEYS = ("role", "content", "chat_time", "name")  # a log turn may name its speaker
# how deep objects and lists may nest in a memory's metadata, the metadata object itself the first level: JSON
# encoders and decoders recurse (pydantic refuses to serialize past about 250 levels, Python past about 1,000),
# so a deeper value could be stored but not read back
MAX_METADATA_DEPTH = 32


def count_tokens(text: str) -> int:
    """Approximate token count (words and punctuation marks), used for the configurable length limit."""
    return len(_TOKEN_RE.findall(text))


def format_time(moment: datetime) -> str:
    """A datetime as the store's fixed-width UTC string (kvmem.utc); naive datetimes are taken as UTC."""
    return utc_text(moment)


def parse_time(value: Any, field_name: str) -> str:
    """An ISO 8601 string or datetime as the store's UTC string; anything else is refused naming the field."""
    if isinstance(value, datetime):
        return _in_range(value, field_name, value)
    if not isinstance(value, str) or not value.strip():
        raise InvalidMemoryInput(f"{field_name} must be an ISO 8601 string or datetime, got {value!r}")
    text = value.strip()
    if text.endswith(("Z", "z")):
        text = text[:-1] + "+00:00"
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise InvalidMemoryInput(f"{field_name} is not an ISO 8601 time: {value!r}") from None
    return _in_range(moment, field_name, value)


def _in_range(moment: datetime, field_name: str, value: Any) -> str:
    try:
        return format_time(moment)
    except OverflowError:
        raise InvalidMemoryInput(f"{field_name} is out of range once in UTC: {value!r}") from None


def check_user_id(user_id: Any) -> str:
    if not isinstance(user_id, str) or not user_id.strip():
        raise InvalidMemoryInput(f"user_id must be a non-empty string, got {user_id!r}")
    return user_id


def check_optional_id(value: Any, field_name: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise InvalidMemoryInput(f"{field_name} must be a non-empty string or None, got {value!r}")
    return value


def check_memory_id(memory_id: Any) -> str:
    if not isinstance(memory_id, str) or not memory_id:
        raise InvalidMemoryInput(f"memory_id must be a non-empty string, got {memory_id!r}")
    return memory_id


def check_int(value: Any, name: str, low: int, high: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise InvalidMemoryInput(f"{name} must be an int in [{low}, {high}], got {value!r}")
    return value


def check_min_score(min_score: Any) -> float | None:
    """A search score floor: None or a finite number (bools refused, though Python counts them as ints)."""
    if min_score is not None and (
        not isinstance(min_score, (int, float)) or isinstance(min_score, bool) or not math.isfinite(min_score)
    ):
        raise InvalidMemoryInput(f"min_score must be a finite number or None, got {min_score!r}")
    return min_score


def check_text(text: Any, max_tokens: int, max_chars: int, field_name: str = "text") -> str:
    """A non-empty string within both limits; characters are counted first (cheap), then tokens."""
    if not isinstance(text, str):
        raise InvalidMemoryInput(f"{field_name} must be a string, got {type(text).__name__}")
    if len(text) > max_chars:
        raise InvalidMemoryInput(f"{field_name} has {len(text)} characters, over the limit of {max_chars}")
    if not text.strip():
        raise InvalidMemoryInput(f"{field_name} is empty")
    num_tokens = count_tokens(text)
    if num_tokens > max_tokens:
        raise InvalidMemoryInput(f"{field_name} has {num_tokens} tokens, over the limit of {max_tokens}")
    return text


def check_tags(tags: Any) -> tuple[str, ...]:
    """Tags as a tuple of non-empty strings, duplicates dropped, first occurrence kept."""
    if tags is None:
        return ()
    if isinstance(tags, str) or not isinstance(tags, (list, tuple)):
        raise InvalidMemoryInput(f"tags must be a list of strings, got {type(tags).__name__}")
    out: list[str] = []
    for tag in tags:
        if not isinstance(tag, str) or not tag.strip():
            raise InvalidMemoryInput(f"tags must hold non-empty strings, got {tag!r}")
        if tag not in out:
            out.append(tag)
    return tuple(out)


def json_depth(value: Any) -> int:
    """How deep dicts and lists nest in `value`: 0 for a scalar, 1 for {} or [1], 2 for {"a": []}. Counted level
    by level, without recursion, so any depth can be measured."""
    depth, level = 0, [value]
    while True:
        containers = [v for v in level if isinstance(v, (dict, list, tuple))]
        if not containers:
            return depth
        depth += 1
        level = [child for c in containers for child in (c.values() if isinstance(c, dict) else c)]


def check_metadata(metadata: Any) -> dict:
    """Metadata as a JSON object with string keys, nested at most MAX_METADATA_DEPTH levels; values must survive
    a JSON round trip unchanged."""
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise InvalidMemoryInput(f"metadata must be a JSON object (dict), got {type(metadata).__name__}")
    depth = json_depth(metadata)
    if depth > MAX_METADATA_DEPTH:
        raise InvalidMemoryInput(
            f"metadata is nested {depth} levels deep, over the limit of {MAX_METADATA_DEPTH} (max_metadata_depth)"
        )
    for key in metadata:
        if not isinstance(key, str):
            raise InvalidMemoryInput(f"metadata keys must be strings, got {key!r}")
    try:
        encoded = json.dumps(metadata, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidMemoryInput(f"metadata is not JSON-serializable: {exc}") from None
    return json.loads(encoded)


class AddItem(NamedTuple):
    """One memory an add call will store: its role (chat messages only), text and chat_time (None: now)."""

    role: str | None
    text: str
    chat_time: str | None


def parse_add_items(
    text: Any, texts: Any, messages: Any, chat_time: Any, max_tokens: int, max_chars: int
) -> list[AddItem]:
    """The memories of one add call, from exactly one of text, texts or chat messages.

    A message's own chat_time wins over the call's; both stay None when not given, so the store stamps them
    with the time it writes.
    """
    if sum(x is not None for x in (text, texts, messages)) != 1:
        raise InvalidMemoryInput("add takes exactly one of text, texts or messages")
    call_time = parse_time(chat_time, "chat_time") if chat_time is not None else None
    items: list[AddItem] = []
    if text is not None:
        items.append(AddItem(None, check_text(text, max_tokens, max_chars), call_time))
    elif texts is not None:
        if isinstance(texts, str) or not isinstance(texts, (list, tuple)) or not texts:
            raise InvalidMemoryInput("texts must be a non-empty list of strings")
        items.extend(
            AddItem(None, check_text(t, max_tokens, max_chars, f"texts[{i}]"), call_time)
            for i, t in enumerate(texts)
        )
    else:
        items.extend(
            AddItem(m.role, m.text, m.chat_time)
            for m in parse_messages(messages, call_time, max_tokens, max_chars, _MESSAGE_KEYS)
        )
    return items


class MessageItem(NamedTuple):
    """One chat message: role, text, chat_time (None: the store stamps it) and speaker name (None: none)."""

    role: str
    text: str
    chat_time: str | None
    name: str | None


def parse_messages(
    messages: Any, call_time: str | None, max_tokens: int, max_chars: int, keys: tuple[str, ...]
) -> list[MessageItem]:
    """Chat messages `[{role, content, chat_time?, name?}]` (only `keys` allowed); a message's own chat_time
    wins over `call_time`."""
    if not isinstance(messages, (list, tuple)) or not messages:
        optional = "".join(f", {k}?" for k in keys[2:])
        raise InvalidMemoryInput(f"messages must be a non-empty list of {{role, content{optional}}}")
    items: list[MessageItem] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidMemoryInput(f"messages[{i}] must be an object, got {type(message).__name__}")
        unknown = sorted(set(message) - set(keys))
        if unknown:
            raise InvalidMemoryInput(f"messages[{i}] has unknown key(s) {unknown}; supported: {list(keys)}")
        role = message.get("role")
        if not isinstance(role, str) or not role.strip():
            raise InvalidMemoryInput(f"messages[{i}].role must be a non-empty string, got {role!r}")
        content = check_text(message.get("content"), max_tokens, max_chars, f"messages[{i}].content")
        when = message.get("chat_time")
        name = check_optional_id(message.get("name"), f"messages[{i}].name")
        items.append(
            MessageItem(
                role, content, parse_time(when, f"messages[{i}].chat_time") if when else call_time, name
            )
        )
    return items


@dataclass(frozen=True)
class TimeRange:
    """Inclusive bounds on chat_time, as the store's UTC strings; either may be None."""

    start: str | None = None
    end: str | None = None


@dataclass(frozen=True)
class SearchFilters:
    """Filters shared by search and list. tags: a memory must carry all of them. metadata: every key equal."""

    session_id: str | None = None
    agent_id: str | None = None
    role: str | None = None
    tags: tuple[str, ...] = ()
    metadata: dict = field(default_factory=dict)
    time_range: TimeRange | None = None

    def __post_init__(self) -> None:
        check_optional_id(self.session_id, "filters.session_id")
        check_optional_id(self.agent_id, "filters.agent_id")
        check_optional_id(self.role, "filters.role")
        if not isinstance(self.tags, tuple) or not all(isinstance(t, str) and t for t in self.tags):
            raise InvalidMemoryInput(f"filters.tags must be a tuple of non-empty strings, got {self.tags!r}")
        if not isinstance(self.metadata, dict):
            raise InvalidMemoryInput(f"filters.metadata must be a dict, got {type(self.metadata).__name__}")
        for key, value in self.metadata.items():
            if not isinstance(key, str) or not key:
                raise InvalidMemoryInput(f"filters.metadata keys must be non-empty strings, got {key!r}")
            if not isinstance(value, _SCALARS) or (isinstance(value, float) and not math.isfinite(value)):
                raise InvalidMemoryInput(
                    f"filters.metadata[{key!r}] must be a string, number, bool or null, got {value!r}"
                )
        if self.time_range is not None:
            if not isinstance(self.time_range, TimeRange):
                raise InvalidMemoryInput("filters.time_range must be a TimeRange")
            start, end = self.time_range.start, self.time_range.end
            if start is not None and end is not None and start > end:
                raise InvalidMemoryInput(f"filters.time_range is inverted: start {start} is after end {end}")

    @property
    def is_empty(self) -> bool:
        return self == _NO_FILTERS


_NO_FILTERS = SearchFilters()


def parse_filters(filters: Any) -> SearchFilters:
    """A SearchFilters from None, a SearchFilters, or the JSON dict form used by the HTTP routes."""
    if filters is None:
        return _NO_FILTERS
    if isinstance(filters, SearchFilters):
        return filters
    if not isinstance(filters, dict):
        raise InvalidMemoryInput(f"filters must be a dict or SearchFilters, got {type(filters).__name__}")
    unknown = sorted(set(filters) - set(_FILTER_KEYS))
    if unknown:
        raise InvalidMemoryInput(f"unknown filter key(s) {unknown}; supported: {list(_FILTER_KEYS)}")
    tags = filters.get("tags")
    if tags is not None and (isinstance(tags, str) or not isinstance(tags, (list, tuple))):
        raise InvalidMemoryInput(f"filters.tags must be a list of strings, got {tags!r}")
    metadata = filters.get("metadata")
    if metadata is None:
        metadata = {}
    time_range = filters.get("time_range")
    if time_range is not None:
        if not isinstance(time_range, dict):
            raise InvalidMemoryInput(f"filters.time_range must be an object, got {time_range!r}")
        extra = sorted(set(time_range) - {"start", "end"})
        if extra:
            raise InvalidMemoryInput(
                f"unknown filters.time_range key(s) {extra}; supported: ['start', 'end']"
            )
        start = time_range.get("start")
        end = time_range.get("end")
        time_range = TimeRange(
            start=None if start is None else parse_time(start, "filters.time_range.start"),
            end=None if end is None else parse_time(end, "filters.time_range.end"),
        )
    return SearchFilters(
        session_id=filters.get("session_id"),
        agent_id=filters.get("agent_id"),
        role=filters.get("role"),
        tags=tuple(tags or ()),
        metadata=metadata,
        time_range=time_range,
    )


def merge_session_id(filters: SearchFilters, session_id: str | None) -> SearchFilters:
    """`filters` narrowed to `session_id` (a list call's own argument); refused if they name another one."""
    if session_id is None:
        return filters
    if filters.session_id is not None and filters.session_id != session_id:
        raise InvalidMemoryInput(
            f"session_id {session_id!r} contradicts filters.session_id {filters.session_id!r}"
        )
    return SearchFilters(**{**filters.__dict__, "session_id": session_id})


def filter_sql(filters: SearchFilters, dialect: Dialect = SQLITE) -> tuple[str, list[Any]]:
    """The filters as ' AND ...' clauses over the memories table aliased `m`, with their parameters; the
    JSON ones (tags, metadata: exact equality by JSON type, so True never matches 1) in `dialect`'s SQL."""
    clauses: list[str] = []
    params: list[Any] = []
    for column in ("session_id", "agent_id", "role"):
        value = getattr(filters, column)
        if value is not None:
            clauses.append(f"m.{column} = ?")
            params.append(value)
    for tag in filters.tags:
        clauses.append(dialect.tag_clause())
        params.append(tag)
    for key, value in filters.metadata.items():
        clause, clause_params = dialect.metadata_clause(key, value)
        clauses.append(clause)
        params.extend(clause_params)
    if filters.time_range is not None:
        if filters.time_range.start is not None:
            clauses.append("m.chat_time >= ?")
            params.append(filters.time_range.start)
        if filters.time_range.end is not None:
            clauses.append("m.chat_time <= ?")
            params.append(filters.time_range.end)
    return "".join(" AND " + c for c in clauses), params


def check_slots(slots: Any, num_items: int) -> list[tuple[str, str] | None]:
    """add's slots: None (no slots), or one (slot, value) or None per memory added."""
    if slots is None:
        return [None] * num_items
    if isinstance(slots, str) or not isinstance(slots, (list, tuple)) or len(slots) != num_items:
        raise InvalidMemoryInput(
            f"slots must be a list of {num_items} (slot, value) pairs or None, got {slots!r}"
        )
    for i, pair in enumerate(slots):
        if pair is None:
            continue
        if (
            not isinstance(pair, (list, tuple))
            or len(pair) != 2
            or not isinstance(pair[0], str)
            or not pair[0].strip()
            or not isinstance(pair[1], str)
        ):
            raise InvalidMemoryInput(
                f"slots[{i}] must be None or a (slot, value) pair of strings, got {pair!r}"
            )
    return [None if pair is None else (pair[0], pair[1]) for pair in slots]

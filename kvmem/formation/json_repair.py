"""The fact items of an LLM's JSON reply, repaired where models commonly break it: code fences, prose around
the object, single quotes, trailing commas, Python literals, and a reply cut off mid-array (the complete
items are kept).

Pure text handling with the stdlib `json`; knows nothing of HTTP or of what a fact means.
"""

from __future__ import annotations

import json
import re

_FENCE = re.compile(r"```[a-zA-Z0-9_-]*\s*\n?(.*?)(?:```|$)", re.S)
_LITERALS = {"None": "null", "True": "true", "False": "false"}


def _strip_fence(text: str) -> str:
    m = _FENCE.search(text)
    return m.group(1) if m else text


def _closes_single(text: str, i: int) -> bool:
    """Whether the single quote at `i` ends a string: only space and then , : } ] or the end follow."""
    rest = text[i + 1 :].lstrip()
    return not rest or rest[0] in ",:}]"


def _to_double_quotes(text: str) -> str:
    """Single-quoted strings as double-quoted ones; an apostrophe inside ('I'm vegan') stays."""
    out: list[str] = []
    i, quote = 0, ""
    while i < len(text):
        ch = text[i]
        if not quote:
            if ch in "\"'":
                quote = ch
                out.append('"')
            else:
                out.append(ch)
        elif ch == "\\" and i + 1 < len(text):
            nxt = text[i + 1]
            out.append("'" if quote == "'" and nxt == "'" else ch + nxt)
            i += 1
        elif ch == quote and (quote == '"' or _closes_single(text, i)):
            quote = ""
            out.append('"')
        elif ch == '"':  # a double quote inside a single-quoted string
            out.append('\\"')
        else:
            out.append(ch)
        i += 1
    return "".join(out)


def _clean_outside_strings(text: str) -> str:
    """Trailing commas dropped and None/True/False as JSON, outside strings (text has double quotes only)."""
    out: list[str] = []
    i, in_string = 0, False
    while i < len(text):
        ch = text[i]
        if in_string:
            out.append(ch)
            if ch == "\\" and i + 1 < len(text):
                out.append(text[i + 1])
                i += 1
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
            out.append(ch)
        elif ch == ",":
            rest = text[i + 1 :].lstrip()
            if not rest.startswith(("}", "]")):
                out.append(ch)
        else:
            word = re.match(r"None|True|False", text[i:])
            if word and (i == 0 or not text[i - 1].isalnum()):
                out.append(_LITERALS[word.group(0)])
                i += len(word.group(0))
                continue
            out.append(ch)
        i += 1
    return "".join(out)


def _matching_close(text: str, start: int) -> int | None:
    """The index just past the bracket that closes the one at `start`, or None when the text ends first."""
    depth, in_string, i = 0, False, start
    while i < len(text):
        ch = text[i]
        if in_string:
            if ch == "\\":
                i += 1
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


def _items_of(value: object) -> list[dict]:
    if isinstance(value, dict):
        value = value.get("facts")
    if not isinstance(value, list):
        raise ValueError("reply has no facts array")
    return [_as_item(item) for item in value if isinstance(item, (dict, str))]


def _as_item(item: dict | str) -> dict:
    """A fact object; a bare string (small models often answer ["I live in Lisbon", ...]) is its text."""
    return item if isinstance(item, dict) else {"text": item}


def _salvage(text: str) -> list[dict]:
    """The complete items (objects, or bare strings) of a facts array cut off before its end."""
    m = re.search(r'"facts"\s*:\s*\[', text)
    start = m.end() if m else (text.index("[") + 1 if text.lstrip().startswith("[") else None)
    if start is None:
        raise ValueError("reply has no facts array")
    decoder = json.JSONDecoder()
    items: list[dict] = []
    i = start
    while True:
        while i < len(text) and text[i] in " \n\r\t,":
            i += 1
        if i >= len(text) or text[i] not in '{"':
            break
        try:
            item, i = decoder.raw_decode(text, i)
        except ValueError:
            break
        if isinstance(item, (dict, str)):
            items.append(_as_item(item))
    if not items:
        raise ValueError("reply was cut off before its first complete fact")
    return items


def fact_items(reply: str) -> list[dict]:
    """The objects of the reply's "facts" array (or of a bare top-level array), repaired as the module says.
    Raises ValueError when no array of facts can be found; an empty array is a valid reply."""
    text = _strip_fence(reply).strip()
    try:
        return _items_of(json.loads(text))
    except ValueError:
        pass
    starts = [i for i in (text.find("{"), text.find("[")) if i >= 0]
    if not starts:
        raise ValueError("reply has no JSON object")
    text = _clean_outside_strings(_to_double_quotes(text[min(starts) :]))
    try:
        value, _ = json.JSONDecoder().raw_decode(text)
        return _items_of(value)
    except ValueError:
        return _salvage(text)

"""The JSON-lines dump format of the plaintext store: one memory per line, with its history and vector.

Owns encoding a stored row to a line and validating a line back into a row; a dump loads back identically
(same ids, times, versions, history, supersession and provenance fields, and vector bytes). Dumps written
before those fields existed load with their defaults (valid_from = chat_time, source 'api'). Knows nothing of
SQLite.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvmem.text.errors import InvalidMemoryInput
from kvmem.text.filters import check_metadata, check_optional_id, check_tags, check_user_id, parse_time
from kvmem.text.records import SOURCES, Memory, MemoryVersion

_FIELDS = (
    "id",
    "user_id",
    "session_id",
    "agent_id",
    "role",
    "text",
    "created_at",
    "chat_time",
    "updated_at",
    "tags",
    "metadata",
    "state",
    "version",
    "history",
)
# Fields added with supersession (schema V2); absent in older dumps.
_LATER = ("valid_from", "valid_to", "superseded_by", "source", "source_turn_ids", "slot", "slot_value")
_OPTIONAL = ("embedding", *_LATER)
_VERSION_FIELDS = ("version", "text", "tags", "metadata", "updated_at")


@dataclass(frozen=True)
class DumpRecord:
    """One line of a dump: the memory, its previous versions, and its vector if the dump carried one."""

    memory: Memory
    history: tuple[MemoryVersion, ...]
    embedder_name: str | None
    vector: np.ndarray | None  # [dim] float32


def encode_line(
    memory: Memory, history: list[MemoryVersion], embedder_name: str | None, vector_bytes: bytes | None
) -> str:
    record: dict[str, Any] = memory.to_dict()
    record["slot_value"] = memory.slot_value  # not in to_dict (the API's shape), but a dump loads back whole
    record["state"] = memory.state  # as stored: to_dict shows a superseded one's (valid_to says it)
    record["history"] = [v.to_dict() for v in history]
    if vector_bytes is not None and embedder_name is not None:
        record["embedding"] = {
            "model": embedder_name,
            "dim": len(vector_bytes) // 4,
            "f32_b64": base64.b64encode(vector_bytes).decode("ascii"),
        }
    return json.dumps(record, ensure_ascii=False, separators=(",", ":"))


MAX_VERSION = 2**62  # a version the stores' 64-bit integer columns hold with room to grow


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise InvalidMemoryInput(f"{where} must be a non-empty string, got {value!r}")
    return value


def _int(value: Any, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_VERSION:
        raise InvalidMemoryInput(f"{where} must be a positive int up to {MAX_VERSION}, got {value!r}")
    return value


def _later_fields(record: dict, where: str) -> dict[str, Any]:
    """The supersession and provenance fields of a line, defaults where an older dump lacks them."""
    out: dict[str, Any] = {}
    for name in ("valid_from", "valid_to"):
        value = record.get(name)
        out[name] = None if value is None else parse_time(value, f"{where}: {name}")
    for name in ("superseded_by", "slot"):
        out[name] = check_optional_id(record.get(name), f"{where}: {name}")
    slot_value = record.get("slot_value")
    if slot_value is not None and not isinstance(slot_value, str):
        raise InvalidMemoryInput(f"{where}: slot_value must be a string or null, got {slot_value!r}")
    out["slot_value"] = slot_value
    source = record.get("source", "api")
    if source not in SOURCES:
        raise InvalidMemoryInput(f"{where}: source must be one of {list(SOURCES)}, got {source!r}")
    out["source"] = source
    turn_ids = record.get("source_turn_ids", [])
    if not isinstance(turn_ids, list) or not all(isinstance(t, str) and t for t in turn_ids):
        raise InvalidMemoryInput(
            f"{where}: source_turn_ids must be a list of non-empty strings, got {turn_ids!r}"
        )
    out["source_turn_ids"] = tuple(turn_ids)
    if (out["valid_to"] is None) != (out["superseded_by"] is None):
        raise InvalidMemoryInput(
            f"{where}: valid_to and superseded_by are set together, got {out['valid_to']!r} and "
            f"{out['superseded_by']!r}"
        )
    return out


def decode_line(line: str, line_no: int) -> DumpRecord:
    """A validated DumpRecord from one line; InvalidMemoryInput names the line and the field."""
    where = f"line {line_no}"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise InvalidMemoryInput(f"{where}: not JSON ({exc.msg})") from None
    if not isinstance(record, dict):
        raise InvalidMemoryInput(f"{where}: expected a JSON object")
    try:  # JSON admits lone surrogates ("\ud83d"), which no store can encode
        json.dumps(record, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidMemoryInput(f"{where}: a string is not valid Unicode (a lone surrogate)") from None
    missing = [k for k in _FIELDS if k not in record]
    unknown = sorted(set(record) - set(_FIELDS) - set(_OPTIONAL))
    if missing or unknown:
        raise InvalidMemoryInput(f"{where}: missing field(s) {missing}, unknown field(s) {unknown}")
    state = record["state"]
    if state not in ("active", "archived"):
        raise InvalidMemoryInput(f"{where}: state must be 'active' or 'archived', got {state!r}")
    try:
        memory = Memory(
            id=_text(record["id"], f"{where}: id"),
            user_id=check_user_id(record["user_id"]),
            session_id=check_optional_id(record["session_id"], f"{where}: session_id"),
            agent_id=check_optional_id(record["agent_id"], f"{where}: agent_id"),
            role=check_optional_id(record["role"], f"{where}: role"),
            text=_text(record["text"], f"{where}: text"),
            created_at=parse_time(record["created_at"], f"{where}: created_at"),
            chat_time=parse_time(record["chat_time"], f"{where}: chat_time"),
            updated_at=parse_time(record["updated_at"], f"{where}: updated_at"),
            tags=check_tags(record["tags"]),
            metadata=check_metadata(record["metadata"]),
            state=state,
            version=_int(record["version"], f"{where}: version"),
            **_later_fields(record, where),
        )
    except InvalidMemoryInput as exc:
        if str(exc).startswith(where):
            raise
        raise InvalidMemoryInput(f"{where}: {exc}") from None
    history_raw = record["history"]
    if not isinstance(history_raw, list):
        raise InvalidMemoryInput(f"{where}: history must be a list")
    history, versions = [], set()
    for i, item in enumerate(history_raw):
        if not isinstance(item, dict) or set(item) != set(_VERSION_FIELDS):
            raise InvalidMemoryInput(
                f"{where}: history[{i}] must have exactly the fields {list(_VERSION_FIELDS)}"
            )
        version = _int(item["version"], f"{where}: history[{i}].version")
        if version >= memory.version:
            raise InvalidMemoryInput(
                f"{where}: history[{i}].version {version} is not below version {memory.version}"
            )
        if version in versions:
            raise InvalidMemoryInput(f"{where}: history[{i}].version {version} appears twice in its history")
        versions.add(version)
        if not isinstance(item["text"], str):
            raise InvalidMemoryInput(f"{where}: history[{i}].text must be a string")
        history.append(
            MemoryVersion(
                version=version,
                text=item["text"],
                tags=check_tags(item["tags"]),
                metadata=check_metadata(item["metadata"]),
                updated_at=parse_time(item["updated_at"], f"{where}: history[{i}].updated_at"),
            )
        )
    embedder_name, vector = None, None
    embedding = record.get("embedding")
    if embedding is not None:
        if not isinstance(embedding, dict) or set(embedding) != {"model", "dim", "f32_b64"}:
            raise InvalidMemoryInput(f"{where}: embedding must have exactly the fields model, dim, f32_b64")
        try:
            raw = base64.b64decode(embedding["f32_b64"], validate=True)
        except (ValueError, TypeError):
            raise InvalidMemoryInput(f"{where}: embedding.f32_b64 is not base64") from None
        if not isinstance(embedding["dim"], int) or len(raw) != 4 * embedding["dim"]:
            raise InvalidMemoryInput(
                f"{where}: embedding has {len(raw)} bytes, not 4 * dim {embedding['dim']!r}"
            )
        embedder_name = str(embedding["model"])
        vector = np.frombuffer(raw, dtype="<f4").astype(np.float32)  # [dim]
        if not np.isfinite(vector).all():  # stored, it failed every hybrid search of the user's after
            raise InvalidMemoryInput(f"{where}: embedding holds a NaN or an infinite value")
    return DumpRecord(memory=memory, history=tuple(history), embedder_name=embedder_name, vector=vector)

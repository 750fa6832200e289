"""Dump lines that passed decode_line and then failed the database write with the driver's own error (a UNIQUE
constraint, a UnicodeEncodeError, an OverflowError), or were stored and broke the user's searches after (a NaN
in a vector): each is refused as InvalidMemoryInput naming its line and field, and nothing is imported."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest

from kvmem.text import HashEmbedder, InvalidMemoryInput, MemoryStore


def _lines(tmp_path) -> list[str]:
    with MemoryStore(tmp_path / "src.db", embedder=HashEmbedder()) as src:
        a = src.add("alice", "I live in Oslo")[0]
        src.update("alice", a.id, text="I live in Bergen")
        src.add("alice", "I like tea")
        out = io.StringIO()
        src.export_jsonl(out)
    return out.getvalue().splitlines()  # [0]: version 2 with one history entry, [1]: version 1


def _history_version_twice(lines):
    record = json.loads(lines[0])
    record["version"] = 3
    record["history"] = [record["history"][0], dict(record["history"][0], text="I live in Paris")]
    return record


def _surrogate(field):
    def make(lines):
        record = json.loads(lines[1])
        record[field] = "I like \ud83d tea"  # "\ud83d" in the file: JSON admits it, UTF-8 cannot hold it
        return record

    return make


def _version(lines):
    return dict(json.loads(lines[1]), version=2**63)


def _vector(bad):
    def make(lines):
        record = json.loads(lines[1])
        vector = np.frombuffer(base64.b64decode(record["embedding"]["f32_b64"]), dtype="<f4").copy()
        vector[0] = bad
        record["embedding"]["f32_b64"] = base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
        return record

    return make


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (_history_version_twice, "line 1: history[1].version 1 appears twice in its history"),
        (_surrogate("text"), "line 1: a string is not valid Unicode (a lone surrogate)"),
        (_surrogate("user_id"), "line 1: a string is not valid Unicode (a lone surrogate)"),
        (_version, f"line 1: version must be a positive int up to {2**62}, got {2**63}"),
        (_vector(np.nan), "line 1: embedding holds a NaN or an infinite value"),
        (_vector(np.inf), "line 1: embedding holds a NaN or an infinite value"),
    ],
)
def test_a_line_the_database_would_refuse_or_that_would_break_search_is_refused_naming_it(
    tmp_path, make, message
):
    lines = _lines(tmp_path)
    dump = "\n".join([json.dumps(make(lines)), lines[1]])
    with MemoryStore(tmp_path / "copy.db", embedder=HashEmbedder()) as copy:
        with pytest.raises(InvalidMemoryInput) as refused:
            copy.import_jsonl(io.StringIO(dump))
        assert str(refused.value) == message
        assert copy.count_by_user() == {}

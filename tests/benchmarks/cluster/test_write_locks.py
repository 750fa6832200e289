"""The write-lock benchmark runs end to end at a tiny size (no timing is asserted): both arms, two replica
processes each, over a PostgreSQL server of its own."""

from __future__ import annotations

import json

import pytest

from benchmarks.cluster import write_locks
from tests.pg import _ensure_binaries

pytestmark = pytest.mark.postgresql


def test_both_arms_write_through_two_replicas(tmp_path, capsys) -> None:
    pytest.importorskip("psycopg")
    _ensure_binaries()
    out = tmp_path / "write_locks.json"
    write_locks.main(
        ["--rounds", "1", "--users", "4", "--duration-s", "1", "--warmup-s", "0.2", "--out", str(out)]
    )
    result = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    assert [(row["round"], row["arm"]) for row in result["rows"]] == [(0, "global"), (0, "per_user")]
    for row in result["rows"]:
        assert row["errors"] == [] and row["writes"] > 0
        assert row["writes"] == round((row["adds_per_s"] + row["turn_logs_per_s"]) * 1)
    assert result["config"] == {
        "replicas": 2,
        "users": 4,
        "rounds": 1,
        "duration_s": 1.0,
        "warmup_s": 0.2,
        "writes": "per user one thread alternating store.add and store.log_turns (user + reply)",
    }
    assert set(result["summary"]) == {"global", "per_user"} and result["env"]["git_sha"]

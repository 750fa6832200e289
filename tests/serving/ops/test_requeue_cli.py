"""`kvmem requeue-dead` (issue 42 item 11): an operator puts every user's dead-lettered turns back in formation
through the store the servers share; a missing store is a usage error (exit 2)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmem.text import MemoryStore
from kvmem.text.records import FormationCounts
from serving.ops.cli import main


def test_requeue_dead_requeues_every_users_dead_turns(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with MemoryStore(tmp_path / "memories.sqlite") as store:
        for user in ("alice", "bob"):
            turns = store.log_turns(user, [{"role": "user", "content": "I live in Lisbon."}])
            store.fail_turns(user, [t.id for t in turns], "openai: HTTP 400", dead=True)
        store.log_turns("carol", [{"role": "user", "content": "still pending"}])
        assert store.formation_counts() == FormationCounts(pending=1, dead=2)
    assert main(["requeue-dead", "--data-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out == "kvmem: 2 dead-lettered turn(s) requeued\n"
    with MemoryStore(tmp_path / "memories.sqlite") as store:
        assert store.formation_counts() == FormationCounts(pending=3, dead=0)
        assert [(t.attempts, t.error) for t in store.pending_turns("alice")] == [(0, None)]


def test_requeue_dead_without_a_store_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["requeue-dead", "--data-dir", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert (
        err
        == f"kvmem requeue-dead: no memory store at {tmp_path / 'none' / 'memories.sqlite'} (wrong --data-dir or --store?)\n"
    )

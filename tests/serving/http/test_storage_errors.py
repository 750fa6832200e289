"""A full disk or a read-only store: writes answer 507 `insufficient_storage` naming what failed, /health says
`degraded` until a write succeeds, and a store that cannot be opened stops startup with one line naming the
path and the cause (exit 1)."""

from __future__ import annotations

import errno
import os
import sqlite3
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from kvmem.text.db.connections import Database
from serving.http.storage import storage_failure
from serving.ops.cli import main
from tests.serving.conftest import ALICE, Stack


def _pragma_on_every_connection(monkeypatch: pytest.MonkeyPatch, *pragmas: str) -> None:
    """A real SQLite failure in the real store: each connection it uses gets `pragma` (query_only: read-only;
    max_page_count: a full disk)."""
    original = Database.conn

    def conn(self: Database) -> sqlite3.Connection:
        c = original(self)
        for pragma in pragmas:
            c.execute(pragma)
        return c

    monkeypatch.setattr(Database, "conn", conn)


def _add(client: TestClient, text: str = "I live in Lisbon.") -> object:
    return client.post("/v1/memories", json={"user_id": "alice", "text": text}, headers=ALICE)


@pytest.mark.parametrize(
    ("pragma", "needle"),
    [
        ("PRAGMA query_only = 1", "attempt to write a readonly database"),
        ("PRAGMA max_page_count = 1", "database or disk is full"),
    ],
)
def test_a_failed_write_is_507_and_health_degrades_until_a_write_succeeds(
    client: TestClient, monkeypatch: pytest.MonkeyPatch, pragma: str, needle: str
) -> None:
    assert client.get("/health").json()["status"] == "ok"
    with monkeypatch.context() as m:
        _pragma_on_every_connection(m, pragma)
        r = _add(client, "x" * 20_000)
        assert r.status_code == 507, r.text
        error = r.json()["error"]
        assert error["code"] == "insufficient_storage" and needle in error["message"]
        health = client.get("/health")
        assert health.status_code == 200
        assert health.json()["status"] == "degraded" and needle in health.json()["storage_error"]
        assert client.get("/v1/memories", params={"user_id": "alice"}, headers=ALICE).status_code == 200
    # the disk takes writes again (the connections kept the pragma)
    _pragma_on_every_connection(monkeypatch, "PRAGMA query_only = 0", "PRAGMA max_page_count = 1073741823")
    assert _add(client).status_code == 201
    body = client.get("/health").json()
    assert body["status"] == "ok" and "storage_error" not in body


@pytest.mark.parametrize(
    "error",
    [
        sqlite3.OperationalError("database or disk is full"),
        OSError(errno.ENOSPC, "No space left on device", "/data/memories.sqlite-wal"),
        OSError(errno.EROFS, "Read-only file system"),
    ],
)
def test_store_errors_on_update_and_delete_are_507(
    client: TestClient, stack: Stack, monkeypatch: pytest.MonkeyPatch, error: Exception
) -> None:
    [memory] = _add(client).json()["memories"]

    def fail(*args: object, **kwargs: object) -> None:
        raise error

    monkeypatch.setattr(stack.store, "update", fail)
    monkeypatch.setattr(stack.store, "delete", fail)
    url = f"/v1/memories/{memory['id']}"
    patched = client.patch(url, json={"user_id": "alice", "text": "I live in Porto."}, headers=ALICE)
    deleted = client.delete(url, params={"user_id": "alice"}, headers=ALICE)
    for r in (patched, deleted):
        assert r.status_code == 507 and r.json()["error"]["code"] == "insufficient_storage"
    assert storage_failure(error) in deleted.json()["error"]["message"]


def test_other_errors_are_not_storage_failures() -> None:
    assert storage_failure(sqlite3.OperationalError("no such table: x")) is None
    assert storage_failure(OSError(errno.ECONNRESET, "reset")) is None
    assert storage_failure(ValueError("x")) is None
    try:
        raise RuntimeError("wrapped") from sqlite3.OperationalError("database or disk is full")
    except RuntimeError as e:
        assert storage_failure(e) == "the disk is full (OperationalError: database or disk is full)"


def _serve(data_dir: Path, capsys: pytest.CaptureFixture) -> tuple[int, str]:
    code = main(["serve", "--no-auth", "--backend", "fake", "--port", "0", "--data-dir", str(data_dir)])
    return code, capsys.readouterr().err


def test_store_file_that_is_a_directory_names_path_and_cause(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    (tmp_path / "memories.sqlite").mkdir()  # sqlite alone says only "unable to open database file"
    code, err = _serve(tmp_path, capsys)
    assert code == 1 and err.count("\n") == 1
    assert f"cannot open the memory store {tmp_path / 'memories.sqlite'}" in err
    assert "is a directory, not a database file" in err


def test_data_dir_under_a_file_names_path_and_cause(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "file").write_text("")
    code, err = _serve(tmp_path / "file" / "data", capsys)
    assert code == 1 and err.count("\n") == 1
    assert f"{tmp_path / 'file'} is a file, not a directory" in err


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_read_only_data_dir_names_path_and_cause(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    tmp_path.chmod(0o555)
    try:
        code, err = _serve(tmp_path, capsys)
    finally:
        tmp_path.chmod(0o755)
    assert code == 1 and f"the data dir {tmp_path} is not writable (Permission denied)" in err

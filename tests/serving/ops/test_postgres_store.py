"""`kvmem serve --store postgresql://...`: the server on the PostgreSQL store (tests/pg.py's real server).
Unreachable at start: one line naming PostgreSQL and where, no password (exit 1). Away while running:
writes answer 503 `dependency_unavailable` naming it; back: the same server serves again by itself."""

from __future__ import annotations

import socket

import pytest
from fastapi.testclient import TestClient

from serving.backends.fake import FakeBackend
from serving.config import ServingConfig
from serving.http.app import create_app
from serving.ops.cli import main
from tests.pg import pg_server, pg_url  # noqa: F401  (fixtures)

pytestmark = pytest.mark.postgresql


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_unreachable_at_start_is_one_line_naming_postgresql_and_where(tmp_path, capsys):
    port = _free_port()
    url = f"postgresql://kv:s3cret@127.0.0.1:{port}/memories"
    code = main(
        [
            "serve",
            "--no-auth",
            "--backend",
            "fake",
            "--port",
            "0",
            "--data-dir",
            str(tmp_path),
            "--store",
            url,
        ]
    )
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1, err
    assert f"StoreUnavailable: postgresql at 127.0.0.1:{port} is unreachable: " in err
    assert "s3cret" not in err


def test_a_store_url_of_another_kind_is_a_usage_error(tmp_path, capsys):
    code = main(
        ["serve", "--no-auth", "--backend", "fake", "--data-dir", str(tmp_path), "--store", "mysql://h/db"]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert "store must be a postgresql://user@host:port/db URL or a SQLite file path, got a mysql: URL" in err


def test_writes_answer_503_while_postgresql_is_away_and_resume_when_it_returns(tmp_path, pg_server, pg_url):  # noqa: F811
    config = ServingConfig(data_dir=tmp_path, backend="fake", auth=False, store=pg_url, store_turns=False)
    assert "postgresql" not in repr(config)  # the URL (it may hold a password) is not in the config's repr
    app = create_app(config, backend=FakeBackend(), formation=None)
    where = f"127.0.0.1:{pg_server.port}"
    with TestClient(app) as client:
        r = client.post("/v1/memories", json={"user_id": "demo", "text": "I live in Lisbon."})
        assert r.status_code == 201, r.text
        assert app.state.store.database_url == pg_url
        pg_server.stop()
        try:
            r = client.post("/v1/memories", json={"user_id": "demo", "text": "I work in Porto."})
            assert r.status_code == 503, r.text
            error = r.json()["error"]
            assert error["code"] == "dependency_unavailable"
            assert error["message"].startswith(f"postgresql at {where} is unreachable: ")
        finally:
            pg_server.start()
        r = client.post("/v1/memories", json={"user_id": "demo", "text": "I work in Porto."})
        assert r.status_code == 201, r.text
        r = client.post(
            "/v1/memories/search", json={"user_id": "demo", "query": "Where do I work?", "top_k": 5}
        )
        assert r.status_code == 200, r.text
        texts = [hit["text"] for hit in r.json()["results"]]
        assert sorted(texts) == ["I live in Lisbon.", "I work in Porto."]


def test_build_and_distill_refuse_a_store_url_of_another_kind(tmp_path, capsys):
    from scheduler.distill import cli as distill_cli
    from serving.ops import build_cli

    assert build_cli.main(["--data-dir", str(tmp_path), "--store", "mysql://h/db"]) == 2
    assert "kvmem build: --store: store must be a postgresql://" in capsys.readouterr().err
    code = distill_cli.main(["--data-dir", str(tmp_path), "--user-id", "u", "--store", "postgres:/h/db"])
    assert code == 2
    assert "kvmem distill: --store: store must be a postgresql://" in capsys.readouterr().err


def test_serving_config_names_a_bad_store():
    with pytest.raises(ValueError, match="store must be a postgresql:// URL or a SQLite file path, got ''"):
        ServingConfig(store="")
    assert ServingConfig(store="postgresql://u@h:5/db").store_path == "postgresql://u@h:5/db"
    assert str(ServingConfig(store="/srv/m.sqlite").store_path) == "/srv/m.sqlite"
    assert str(ServingConfig(data_dir="/d").store_path) == "/d/memories.sqlite"


def test_kvmem_build_over_a_postgresql_store(tmp_path, tiny_model_dir, pg_url, capsys):  # noqa: F811
    import json

    from kvmem.text import MemoryStore
    from serving.ops import build_cli

    src = tmp_path / "blocks.jsonl"
    src.write_text(
        json.dumps({"user_id": "alice", "memories": ["I live in Lisbon.", "I have a cat."]}) + "\n"
    )
    data = tmp_path / "data"
    argv = ["--input", str(src), "--model", str(tiny_model_dir), "--data-dir", str(data), "--no-progress"]
    assert build_cli.main([*argv, "--store", pg_url]) == 0
    assert (
        "built 1, skipped 0 (already valid), failed 0; added 2 memories to the store"
        in capsys.readouterr().err
    )
    with MemoryStore(pg_url) as store:  # the memories went to PostgreSQL, not to the data dir's file
        assert sorted(m.text for m in store.list("alice").items) == ["I have a cat.", "I live in Lisbon."]
    assert not (data / "memories.sqlite").exists()
    assert len(list((data / "kv").rglob("*.safetensors"))) == 1

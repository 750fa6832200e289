"""A failed or interrupted `scripts/cluster.sh up` leaves nothing running, and `down` stops what `up` started
(issue 42 item 26): cluster.json names PostgreSQL before it starts, and the script stops what it started when
it is sent SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from kvmem.text.db.pg_server import PgServer, PgServerError, find_bin_dir
from serving.ops.cluster import ClusterError, ClusterState, alive, down, free_port, pg_location, up
from tests.cluster.conftest import ensure_binaries

pytestmark = [pytest.mark.redis, pytest.mark.postgresql]

REPO = Path(__file__).resolve().parents[3]


def _postgres(root: Path) -> PgServer:
    """The cluster's PostgreSQL under `root`, whether or not it runs (pg_ctl finds it by its directory)."""
    return PgServer(pg_location(root.resolve()), 0, find_bin_dir(), os.geteuid() == 0)


def _stop_leftovers(root: Path) -> None:
    """What a failing test leaves running (the code before the fix did)."""
    pg = _postgres(root)
    if (pg.data_dir / "postmaster.pid").exists():
        pg.stop()
    down(root)


def test_an_up_that_fails_after_postgresql_started_stops_it(tmp_path, monkeypatch) -> None:
    ensure_binaries()
    where = tmp_path / "c"

    def refuse(self: PgServer, name: str) -> str:
        raise PgServerError(f'CREATE DATABASE "{name}" refused (the test)')

    monkeypatch.setattr(PgServer, "create_database", refuse)
    try:
        with pytest.raises(ClusterError) as failed:
            up(where, 1, ["--backend", "fake", "--no-auth"], wait_s=60)
        pg = _postgres(where)
        assert str(failed.value) == (
            f'PostgreSQL could not be started in {pg.root}: CREATE DATABASE "kvmem" refused (the test)'
        )
        assert (pg.data_dir / "PG_VERSION").is_file()  # it was initialized and started ...
        assert not (pg.data_dir / "postmaster.pid").exists() and not pg.running()  # ... and is stopped
        assert ClusterState.load(where.resolve()) is None and down(where) == []
    finally:
        _stop_leftovers(where)


def test_an_up_sent_sigterm_stops_what_it_started_and_down_finds_nothing_left(tmp_path) -> None:
    ensure_binaries()
    where = tmp_path / "c"
    # the replica listens on a port of its own choosing, so it never answers the health check `up` waits for
    serve = ["--backend", "fake", "--no-auth", "--port", str(free_port())]
    script = ["bash", str(REPO / "scripts" / "cluster.sh"), "up", "--replicas", "1", "--dir", str(where)]
    proc = subprocess.Popen(
        [*script, "--wait-s", "300", "--", *serve], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        state = None
        for _ in range(1500):  # bounded (5 min): until up has started PostgreSQL, Redis and the replica
            state = ClusterState.load(where.resolve())
            if state is not None and state.replicas and alive(state.replicas[0].pid):
                break
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.2)
        assert state is not None and state.replicas and state.pg_port
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 128 + signal.SIGTERM, err
        assert err.strip().splitlines()[-1] == (
            "cluster: error: interrupted by SIGTERM; what was started is stopped again"
        )
        assert not alive(state.replicas[0].pid) and not alive(state.redis_pid)
        pg = _postgres(where)
        assert not (pg.data_dir / "postmaster.pid").exists() and not pg.running()
        assert ClusterState.load(where.resolve()) is None and down(where) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        _stop_leftovers(where)

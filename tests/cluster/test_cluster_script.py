"""`scripts/cluster.sh up|status|down` as a user runs it: three replicas of the fake backend, the router's URL
as the last line of `up`, every replica reachable through it, and `down` stopping every process it started."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

import httpx
import pytest

from serving.ops.cluster import ClusterState, alive
from tests.cluster.conftest import chat, ensure_binaries

pytestmark = [pytest.mark.redis, pytest.mark.postgresql]

REPO = Path(__file__).resolve().parents[2]


def script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(REPO / "scripts" / "cluster.sh"), *args], capture_output=True, text=True, timeout=600
    )


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_up_prints_the_router_last_and_down_stops_everything(tmp_path: Path) -> None:
    ensure_binaries()
    where = tmp_path / "c"
    up = script("up", "--replicas", "3", "--dir", str(where), "--", "--backend", "fake", "--no-auth")
    try:
        assert up.returncode == 0, up.stderr[-3000:]
        state = ClusterState.load(where.resolve())
        assert up.stdout.splitlines()[-1] == state.router_url
        replicas = {
            chat(state.router_url, f"u{i}", **{"X-Kvmem-User": f"u{i}"}).headers["x-kvmem-replica"]
            for i in range(30)
        }
        assert replicas == {"r1", "r2", "r3"}
        assert httpx.get(f"{state.router_url}/health", timeout=30).status_code == 200
        again = script("up", "--replicas", "1", "--dir", str(where))
        assert again.returncode == 1 and "a cluster is already up in" in again.stderr
        status = script("status", "--dir", str(where))
        assert status.stdout.splitlines()[:3] == [f"replica {r.id}: {r.url} up" for r in state.replicas]
    finally:
        down = script("down", "--dir", str(where))
    assert down.returncode == 0, down.stderr
    assert down.stdout.strip() == "stopped: replica r1, replica r2, replica r3, router, redis, postgresql"
    pids = [r.pid for r in state.replicas] + [state.router_pid, state.redis_pid]
    assert not any(alive(pid) for pid in pids)
    assert not any(listening(p) for p in [state.router_port, state.redis_port, state.pg_port])
    assert script("down", "--dir", str(where)).stdout.strip() == "stopped: nothing was running"


def test_bad_arguments_are_named(tmp_path: Path) -> None:
    r = script("up", "--replicas", "0", "--dir", str(tmp_path / "c"))
    assert r.returncode == 1 and r.stderr.strip() == "cluster: error: --replicas must be at least 1, got 0"

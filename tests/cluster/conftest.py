"""A real cluster on loopback for the cluster tests: PostgreSQL, Redis, replicas of `kvmem serve` and HAProxy,
started by the product's own `serving.ops.cluster.up` (what `scripts/cluster.sh up` runs) and stopped by `down`.

The module-scoped `fake_cluster` runs two replicas over the fake backend (scripted replies; what is tested
is routing, sharing and failure, not model math); tests/cluster/test_failover_kv.py starts its own over the
real default model. Binaries come from Debian packages, installed with apt when missing.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvmem.text.db.pg_server import find_bin_dir
from serving.ops.cluster import ClusterState, down, up
from tests import debian


def ensure_binaries() -> None:
    pytest.importorskip("psycopg")
    debian.ensure("haproxy", "haproxy")
    debian.ensure("redis-server", "redis-server")
    debian.ensure("pg_ctl", "postgresql", find=find_bin_dir)


def start_cluster(root: Path, replicas: int, serve_args: list[str]) -> ClusterState:
    ensure_binaries()
    try:
        return up(root, replicas, serve_args, wait_s=300)
    except BaseException:
        down(root)
        raise


@pytest.fixture(scope="module")
def fake_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterState]:
    root = tmp_path_factory.mktemp("cluster")
    state = start_cluster(root, 2, ["--backend", "fake", "--no-auth", "--log-level", "warning"])
    try:
        yield state
    finally:
        down(root)


def wait_until(check, timeout_s: float = 20.0, every_s: float = 0.1):
    """Polls `check()` until it returns something truthy (returned) or `timeout_s` passes (AssertionError)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {timeout_s} s: {check}")
        time.sleep(every_s)


def chat(base: str, user: str, content: str = "what do you know about me?", **headers: str) -> httpx.Response:
    body = {"model": "default", "user": user, "messages": [{"role": "user", "content": content}]}
    return httpx.post(f"{base}/v1/chat/completions", json=body, headers=headers, timeout=60)

"""Failover over the real default model: a user's replica builds their block into the shared data dir; it is
killed (-9); the router sends the user to the other replica, which serves even their first request there from
that stored block (the same item, found by its content address: no prefill of the block, no new item)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import pytest

from serving.ops.cluster import down
from tests.cluster.conftest import chat, start_cluster, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.redis, pytest.mark.postgresql]


def test_a_killed_replicas_user_is_served_from_the_stored_block_by_another(tmp_path: Path) -> None:
    root = tmp_path / "cluster"
    serve = ["--no-auth", "--no-store-turns", "--log-level", "warning", "--kv-pool-mb", "256"]
    state = start_cluster(root, 2, serve)
    try:
        user = "gina"
        header = {"X-Kvmem-User": user}
        base = state.router_url
        texts = ["My sister Ines plays the cello in Lisbon.", "I am allergic to peanuts.", "My cat is Tofu."]
        for text in texts:
            r = httpx.post(
                f"{base}/v1/memories", json={"user_id": user, "text": text}, headers=header, timeout=60
            )
            assert r.status_code == 201, r.text
        first = chat(base, user, **header)
        home = first.headers["x-kvmem-replica"]

        def block() -> dict | None:
            r = httpx.get(f"{base}/v1/memories/plan", params={"user_id": user}, headers=header, timeout=60)
            b = r.json()["block"]
            return b if b is not None and len(b["memory_ids"]) == len(texts) else None

        built = wait_until(block, timeout_s=120, every_s=0.5)
        served = chat(base, user, **header)
        assert served.headers["x-kvmem-replica"] == home
        assert served.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == built["tokens"]
        items = sorted(
            p.relative_to(state.data_dir) for p in (state.data_dir / "kv").rglob("*") if p.is_file()
        )
        stamps = {p: (state.data_dir / p).stat().st_mtime_ns for p in items}

        victim = next(r for r in state.replicas if r.id == home)
        os.kill(victim.pid, signal.SIGKILL)

        def from_the_other() -> httpx.Response | None:
            try:
                r = chat(base, user, **header)
            except httpx.HTTPError:
                return None
            return r if r.status_code == 200 and r.headers["x-kvmem-replica"] != home else None

        again = wait_until(from_the_other, timeout_s=30, every_s=0.2)
        # her first answer there is already from KV: her first read restored the stored block (no prefill)
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == built["tokens"]
        assert block()["item_id"] == built["item_id"]  # the same stored item, found by its content address
        after = sorted(
            p.relative_to(state.data_dir) for p in (state.data_dir / "kv").rglob("*") if p.is_file()
        )
        assert after == items and {p: (state.data_dir / p).stat().st_mtime_ns for p in after} == stamps
    finally:
        down(root)

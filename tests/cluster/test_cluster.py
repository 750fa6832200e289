"""Replicas across one PostgreSQL, one Redis and one data dir, behind HAProxy (fake backend; real PostgreSQL,
Redis and router on loopback): sticky users, a write visible everywhere at once, a DELETE through one replica
stopping every replica before it returns, dependencies going away and coming back, and kill -9 of a replica
under writes. `scripts/cluster.sh` itself: tests/cluster/test_cluster_script.py."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from serving.ops.cluster import ClusterState, alive, start_redis, start_replica, wait_http
from tests.cluster.conftest import chat, wait_until

pytestmark = [pytest.mark.redis, pytest.mark.postgresql]

USERS = [f"user-{i}" for i in range(12)]


def replica_of(state: ClusterState, user: str) -> str:
    r = chat(state.router_url, user, **{"X-Kvmem-User": user})
    assert r.status_code == 200, r.text
    return r.headers["x-kvmem-replica"]


def answered_by(state: ClusterState, user: str) -> str | None:
    """The replica that answers the user's chat now; None while the router has nowhere to send it."""
    try:
        r = chat(state.router_url, user, **{"X-Kvmem-User": user})
    except httpx.HTTPError:
        return None
    return r.headers.get("x-kvmem-replica") if r.status_code == 200 else None


def add(base: str, user: str, text: str) -> httpx.Response:
    return httpx.post(f"{base}/v1/memories", json={"user_id": user, "text": text}, timeout=30)


def stored_ids(base: str, user: str) -> set[str]:
    ids: set[str] = set()
    for page in range(1, 1000):
        r = httpx.get(
            f"{base}/v1/memories", params={"user_id": user, "page": page, "page_size": 100}, timeout=30
        )
        assert r.status_code == 200, r.text
        ids |= {m["id"] for m in r.json()["data"]}
        if page * 100 >= r.json()["total"]:
            return ids
    raise AssertionError("more than 1000 pages")


def plan_block(base: str, user: str) -> dict | None:
    r = httpx.get(f"{base}/v1/memories/plan", params={"user_id": user}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["block"]


def served_kv(response: httpx.Response) -> int:
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def with_a_block(state: ClusterState, user: str, texts: list[str]) -> tuple[str, str, list[str], dict]:
    """The user's memories added on the replica that serves them, and their block built there: (that replica's
    URL, another replica's URL, the memory ids, the block as the plan route shows it)."""
    home = replica_of(state, user)
    serving = next(r.url for r in state.replicas if r.id == home)
    other = next(r.url for r in state.replicas if r.id != home)
    ids = [add(serving, user, text).json()["memories"][0]["id"] for text in texts]
    chat(serving, user)  # asks for their plan: their replica builds their block
    block = wait_until(
        lambda: (b := plan_block(serving, user)) and sorted(b["memory_ids"]) == sorted(ids) and b
    )
    return serving, other, ids, block


def test_each_user_stays_on_one_replica_and_users_spread(fake_cluster: ClusterState) -> None:
    base = fake_cluster.router_url
    seen: dict[str, set[str]] = {u: set() for u in USERS}
    for _ in range(3):
        for user in USERS:
            header = {"X-Kvmem-User": user}
            answers = [
                chat(base, user, **header),  # the chat's `user` and the header
                chat(base, user),  # the chat's `user` alone
                httpx.post(f"{base}/v1/memories/search", json={"user_id": user, "query": "x"}, timeout=30),
                httpx.get(f"{base}/v1/memories", params={"user_id": user}, timeout=30),
                httpx.get(f"{base}/v1/models", headers=header, timeout=30),
            ]
            for r in answers:
                assert r.status_code == 200, r.text
                seen[user].add(r.headers["x-kvmem-replica"])
    assert all(len(replicas) == 1 for replicas in seen.values()), seen
    assert {next(iter(r)) for r in seen.values()} == {"r1", "r2"}  # twelve users do not all hash to one


def test_a_memory_added_through_one_replica_is_searchable_through_another_at_once(
    fake_cluster: ClusterState,
) -> None:
    r1, r2 = (r.url for r in fake_cluster.replicas)
    r = add(r1, "carol", "my sister Ines plays the cello")
    assert r.status_code == 201, r.text
    memory_id = r.json()["memories"][0]["id"]
    hits = httpx.post(f"{r2}/v1/memories/search", json={"user_id": "carol", "query": "cello"}, timeout=30)
    assert [h["id"] for h in hits.json()["results"]] == [memory_id]
    assert (
        httpx.get(f"{r2}/v1/memories/{memory_id}", params={"user_id": "carol"}, timeout=30).status_code == 200
    )


def test_a_delete_through_one_replica_stops_every_replica_serving_it_before_it_returns(
    fake_cluster: ClusterState,
) -> None:
    user = "dora"
    serving, other, ids, block = with_a_block(fake_cluster, user, ["my dog is Rex", "I live in Porto"])
    assert served_kv(chat(serving, user)) == block["tokens"]

    r = httpx.delete(f"{other}/v1/memories/{ids[0]}", params={"user_id": user}, timeout=30)
    assert r.status_code == 200 and r.json()["deleted"] == 1, r.text
    after = plan_block(serving, user)  # the DELETE has returned: her replica no longer serves that block
    assert after is None or ids[0] not in after["memory_ids"]
    out = chat(serving, user)
    assert ids[0] not in [u["id"] for u in out.json()["memory"]["used"]]


def test_postgresql_away_writes_answer_503_resident_kv_still_serves_and_it_comes_back(
    fake_cluster: ClusterState,
) -> None:
    user = "erin"
    base, _, _, block = with_a_block(fake_cluster, user, ["my cat is Tofu"])
    pg = fake_cluster.pg()
    pg.stop()
    try:
        r = add(base, user, "I like tea")
        assert r.status_code == 503, r.text
        error = r.json()["error"]
        assert error["code"] == "dependency_unavailable"
        assert error["message"].startswith(f"postgresql at 127.0.0.1:{fake_cluster.pg_port} is unreachable")
        assert served_kv(chat(base, user)) == block["tokens"]  # her block is resident: still served
        health = httpx.get(f"{base}/health", timeout=30)
        assert health.status_code == 200 and health.json()["status"] == "degraded", health.text
    finally:
        pg.start()
    r = wait_until(lambda: (r := add(base, user, "I like tea")).status_code == 201 and r, timeout_s=30)
    hits = httpx.post(f"{base}/v1/memories/search", json={"user_id": user, "query": "tea"}, timeout=30)
    assert hits.json()["results"][0]["id"] == r.json()["memories"][0]["id"]


def test_redis_away_deletes_answer_503_and_nothing_is_deleted_until_it_comes_back(
    fake_cluster: ClusterState,
) -> None:
    user = "fay"
    base = fake_cluster.replicas[0].url
    memory_id = add(base, user, "my bike is red").json()["memories"][0]["id"]
    os.kill(fake_cluster.redis_pid, signal.SIGKILL)
    wait_until(lambda: not alive(fake_cluster.redis_pid))
    try:
        r = httpx.delete(f"{base}/v1/memories/{memory_id}", params={"user_id": user}, timeout=30)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "dependency_unavailable"
        assert r.json()["error"]["message"].startswith(
            f"redis at 127.0.0.1:{fake_cluster.redis_port} is unreachable"
        )
        assert (
            httpx.get(f"{base}/v1/memories/{memory_id}", params={"user_id": user}, timeout=30).status_code
            == 200
        )
        assert chat(base, user).status_code == 200  # chats are served (as text: the fence cannot be read)
    finally:
        fake_cluster.redis_pid = start_redis(fake_cluster)
        fake_cluster.save()
    r = wait_until(
        lambda: (
            (
                r := httpx.delete(f"{base}/v1/memories/{memory_id}", params={"user_id": user}, timeout=30)
            ).status_code
            == 200
            and r
        ),
        timeout_s=30,
    )
    assert r.json()["deleted"] == 1


def test_kill_9_of_a_replica_under_writes_loses_nothing_acknowledged_and_moves_its_users(
    fake_cluster: ClusterState,
) -> None:
    base = fake_cluster.router_url
    homes = {user: replica_of(fake_cluster, user) for user in USERS}
    victim = fake_cluster.replicas[0]
    moved = [u for u in USERS if homes[u] == victim.id]
    acknowledged: dict[str, list[str]] = {u: [] for u in USERS}
    failed = [0]
    stop = threading.Event()

    def writer(users: list[str]) -> None:
        n = 0
        while not stop.is_set():
            for user in users:
                try:
                    r = add(base, user, f"note {n} of {user}")
                except httpx.HTTPError:
                    failed[0] += 1
                    time.sleep(0.05)
                    continue
                if r.status_code == 201:
                    acknowledged[user].append(r.json()["memories"][0]["id"])
                else:
                    failed[0] += 1
                    time.sleep(0.05)
            n += 1

    threads = [threading.Thread(target=writer, args=(USERS[i::3],)) for i in range(3)]
    for t in threads:
        t.start()
    try:
        time.sleep(2.0)
        os.kill(victim.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        back = wait_until(
            lambda: (
                all(answered_by(fake_cluster, u) not in (None, victim.id) for u in moved) and time.monotonic()
            )
        )
        time.sleep(1.0)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    survivor = next(r.url for r in fake_cluster.replicas if r.id != victim.id)
    for user in USERS:
        assert set(acknowledged[user]) <= stored_ids(survivor, user), user
    assert sum(map(len, acknowledged.values())) > 0 and back - killed_at < 15.0

    restarted = start_replica(fake_cluster, victim.id, victim.port)
    fake_cluster.replicas[0] = restarted
    fake_cluster.save()
    wait_http(f"{restarted.url}/health", restarted.pid, 120, "replica r1", restarted.log_path)
    wait_until(lambda: all(replica_of(fake_cluster, u) == homes[u] for u in USERS), timeout_s=20)

"""`kvmem build --data-dir D` builds the blocks the server will serve, and a server started on D restores
its plans from them: every user's first chat is served from KV, with nothing prefilled by the scheduler.

The server here is the real one (`create_app`, the transformers backend, its scheduler and worker thread) on a
tiny random llama saved to disk; the slow test does the same on the real default model, through the official
openai client.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from kvmem.kv.io import list_item_ids
from kvmem.text import MemoryStore
from scheduler import SchedulerConfig
from scheduler.heat import HeatTable
from serving.config import ServingConfig
from serving.http.app import create_app
from serving.ops.build_cli import main as build_main

ALICE = [
    "Alice lives in Lisbon.",
    "Alice has a cat named Miso.",
    "Alice plays the cello on Sundays.",
    "Alice is allergic to peanuts.",
    "Alice works as a nurse at night.",
    "Alice's sister is called Ines.",
]
BOB = ["Bob collects stamps.", "Bob's favourite colour is teal."]
BUDGET = 24  # tokens: alice's memories do not all fit, so her heat decides which are served


def seed(data: Path) -> dict[str, list[str]]:
    """Memories, and heat as a past server left it: alice's last two memories were asked about."""
    with MemoryStore(data / "memories.sqlite") as store:
        alice = [m.id for m in store.add("alice", texts=ALICE)]
        store.add("bob", texts=BOB)
    cfg = SchedulerConfig()
    heat = HeatTable(
        data / "scheduler" / "heat.sqlite",
        half_life_s=cfg.half_life_s,
        use_weight=cfg.use_weight,
        recency_prior=cfg.recency_prior,
    )
    heat.record("alice", alice[-2:], alice[-2:], time.time())
    heat.close()
    return {"alice": alice}


def wait_ready(client: TestClient, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while client.get("/health").status_code != 200:
        assert time.monotonic() < deadline, "the server never became ready"
        time.sleep(0.05)


def serve_first_chats(data: Path, model: str, users: list[str]) -> dict[str, object]:
    config = ServingConfig(
        data_dir=data, model=model, auth=False, block_token_budget=BUDGET, store_turns=False
    )
    items_before = set(list_item_ids(data / "kv"))
    app = create_app(config)
    out: dict[str, object] = {}
    with TestClient(app) as client:
        wait_ready(client)
        scheduler = app.state.scheduler
        out["plans"] = {u: scheduler.plans.get(u).block for u in users}
        for user in users:
            r = client.post(
                "/v1/chat/completions",
                json={
                    "model": app.state.backend.model_id,
                    "user": user,
                    "messages": [{"role": "user", "content": "Hi"}],
                },
            )
            assert r.status_code == 200, r.text
            out[user] = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        scheduler.flush()
        out["prefills"] = scheduler.stats().prefills
    out["new_items"] = set(list_item_ids(data / "kv")) - items_before
    return out


def test_build_then_restart_serves_first_chat_from_kv(tmp_path, tiny_model_dir, capsys):
    data = tmp_path / "data"
    ids = seed(data)
    argv = ["--data-dir", str(data), "--model", str(tiny_model_dir), "--no-progress"]
    assert build_main([*argv, "--block-token-budget", str(BUDGET)]) == 0
    assert "built 2, skipped 0 (already valid), failed 0 (model loaded)" in capsys.readouterr().err
    built = set(list_item_ids(data / "kv"))

    got = serve_first_chats(data, str(tiny_model_dir), ["alice", "bob"])
    plans = got["plans"]
    assert {p.item_id for p in plans.values()} == built  # restored at start, before any request
    assert plans["alice"].memory_ids[:2] == tuple(sorted(ids["alice"][-2:]))  # her hot ones lead
    assert len(plans["alice"].memory_ids) < len(ALICE)  # the budget held: the policy chose
    assert got["alice"] == plans["alice"].num_tokens > 0
    assert got["bob"] == plans["bob"].num_tokens > 0
    assert got["prefills"] == 0 and got["new_items"] == set()

    # resume with nothing changed: everything verifies, the weights are not loaded
    assert build_main([*argv, "--block-token-budget", str(BUDGET)]) == 0
    assert "built 0, skipped 2 (already valid), failed 0 (model not loaded)" in capsys.readouterr().err


def test_bad_users_are_reported_and_skipped(tmp_path, tiny_model_dir, capsys):
    data = tmp_path / "data"
    seed(data)
    users = tmp_path / "users.txt"
    users.write_text("nobody\nbob\n")
    argv = ["--data-dir", str(data), "--model", str(tiny_model_dir), "--no-progress", "--users", str(users)]
    assert build_main(argv) == 1
    err = capsys.readouterr().err
    assert "user 'nobody': the user has no memories in this data dir" in err
    assert "built 1, skipped 0 (already valid), failed 1 (model loaded)" in err
    assert build_main(["--data-dir", str(data), "--user-id", "bob", "--model", str(tiny_model_dir)]) == 0
    assert "built 0, skipped 1 (already valid), failed 0 (model not loaded)" in capsys.readouterr().err
    assert build_main(["--users", str(tmp_path / "none.txt")]) == 2


def test_a_build_with_nothing_changed_since_the_last_returns_at_once(
    tmp_path, tiny_model_dir, capsys, monkeypatch
):
    """Issue 27 item 17: after a complete build, a build over an unchanged data dir says so and returns without
    opening the planner (no tokenizer, model, store or item hashing); a changed memory, a removed item,
    other settings or --recheck check every block again."""
    import serving.ops.offline_build

    data = tmp_path / "data"
    seed(data)
    argv = ["--data-dir", str(data), "--model", str(tiny_model_dir), "--no-progress"]
    assert build_main([*argv, "--block-token-budget", str(BUDGET)]) == 0
    assert "built 2, skipped 0 (already valid), failed 0 (model loaded)" in capsys.readouterr().err
    planner = serving.ops.offline_build.OfflinePlanner

    def no_planner(*args, **kwargs):
        raise AssertionError("the fast path opened the planner")

    monkeypatch.setattr(serving.ops.offline_build, "OfflinePlanner", no_planner)
    assert build_main([*argv, "--block-token-budget", str(BUDGET)]) == 0
    err = capsys.readouterr().err
    assert "nothing changed since the last build (" in err and "2 users): nothing to build" in err
    assert "built" not in err.replace("the last build", "")
    monkeypatch.setattr(serving.ops.offline_build, "OfflinePlanner", planner)
    assert build_main([*argv, "--block-token-budget", str(BUDGET), "--recheck"]) == 0
    assert "built 0, skipped 2 (already valid), failed 0 (model not loaded)" in capsys.readouterr().err
    assert build_main([*argv, "--block-token-budget", str(BUDGET + 1)]) == 0  # other settings: checked
    assert "failed 0" in capsys.readouterr().err
    assert build_main([*argv, "--block-token-budget", str(BUDGET + 1)]) == 0
    assert "nothing changed" in capsys.readouterr().err  # the stamp is the last complete build's

    with MemoryStore(data / "memories.sqlite") as store:  # bob's memories change: his block is built
        store.add("bob", "Bob has a parrot.")
    assert build_main([*argv, "--block-token-budget", str(BUDGET)]) == 0
    assert "built 1, skipped 1 (already valid), failed 0" in capsys.readouterr().err
    assert build_main([*argv, "--block-token-budget", str(BUDGET)]) == 0
    assert "nothing changed" in capsys.readouterr().err
    for path in (data / "kv").rglob("*.safetensors"):  # the items removed behind the build's back: rebuilt
        path.unlink()
    assert build_main([*argv, "--block-token-budget", str(BUDGET)]) == 0
    assert "built 2, skipped 0 (already valid), failed 0 (model loaded)" in capsys.readouterr().err


def test_build_for_another_model_is_picked_up_by_a_server_on_it(tmp_path, tiny_model_dir, tiny_handle):
    """The upgrade case: items for model B are built beside model A's; each server serves its own."""
    data = tmp_path / "data"
    seed(data)
    other = tmp_path / "model-b"
    with torch.no_grad():
        model_b = type(tiny_handle.model)(tiny_handle.model.config)
        model_b.load_state_dict(tiny_handle.model.state_dict())
        next(model_b.parameters()).add_(0.01)  # other weights: another fingerprint
    model_b.save_pretrained(other)
    tiny_handle.tokenizer.save_pretrained(other)
    for model in (tiny_model_dir, other):
        argv = ["--data-dir", str(data), "--model", str(model), "--no-progress"]
        assert build_main([*argv, "--block-token-budget", str(BUDGET)]) == 0
    assert len(list_item_ids(data / "kv")) == 4
    got = serve_first_chats(data, str(other), ["alice", "bob"])
    assert got["alice"] > 0 and got["bob"] > 0
    assert got["prefills"] == 0 and got["new_items"] == set()


@pytest.mark.slow
def test_real_model_build_then_restart_through_the_openai_client(tmp_path, capsys):
    """The real default model: `kvmem build` over a data dir, then a live server on it; each user's first
    chat through the official client is served from KV and the scheduler prefilled nothing."""
    import httpx
    from openai import OpenAI

    from tests.serving.conftest import live_server

    data = tmp_path / "data"
    seed(data)
    argv = ["--data-dir", str(data), "--no-progress", "--block-token-budget", str(BUDGET)]
    assert build_main(argv) == 0
    assert "built 2, skipped 0 (already valid), failed 0 (model loaded)" in capsys.readouterr().err
    built = set(list_item_ids(data / "kv"))
    config = ServingConfig(data_dir=data, auth=False, block_token_budget=BUDGET, store_turns=False)
    app = create_app(config)
    with live_server(app) as url:
        deadline = time.monotonic() + 300
        while httpx.get(f"{url}/health").status_code != 200:
            assert time.monotonic() < deadline, "the server never became ready"
            time.sleep(0.2)
        scheduler = app.state.scheduler
        assert {scheduler.plans.get(u).block.item_id for u in ("alice", "bob")} == built
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        for user in ("alice", "bob"):
            out = client.chat.completions.create(
                model=app.state.backend.model_id,
                messages=[{"role": "user", "content": "What do you know about me?"}],
                user=user,
                max_tokens=8,
            )
            block = scheduler.plans.get(user).block
            assert out.usage.prompt_tokens_details.cached_tokens == block.num_tokens > 0
        scheduler.flush()
        assert scheduler.stats().prefills == 0
    assert set(list_item_ids(data / "kv")) == built


def test_knowledge_block_served_and_changed_knowledge_never_serves_stale(tmp_path, tiny_model_dir, capsys):
    """`kvmem build --knowledge`: the server serves [knowledge][memories] from KV on the first chat. Knowledge
    changed afterwards (installed, children not built): no old block is restored or served; the scheduler
    rebuilds in the background, under the new knowledge item."""
    from kvmem.kv import knowledge
    from kvmem.kv.io import read_manifest

    data = tmp_path / "data"
    seed(data)
    kfile = tmp_path / "faq.txt"
    kfile.write_text("The shop opens at 9am.\nReturns within 30 days.\n")
    argv = ["--data-dir", str(data), "--model", str(tiny_model_dir), "--no-progress"]
    assert build_main([*argv, "--knowledge", str(kfile), "--block-token-budget", str(BUDGET)]) == 0
    assert "built 2, skipped 0 (already valid), failed 0" in capsys.readouterr().err
    got = serve_first_chats(data, str(tiny_model_dir), ["alice", "bob"])
    parents = {
        p.item_id: read_manifest(data / "kv", p.item_id)["meta"]["parent_id"] for p in got["plans"].values()
    }
    assert len(set(parents.values())) == 1 and None not in parents.values()  # one shared knowledge item
    assert got["alice"] == got["plans"]["alice"].num_tokens and got["prefills"] == 0

    knowledge.install(data, ["The shop now opens at 10am."])
    config = ServingConfig(
        data_dir=data, model=str(tiny_model_dir), auth=False, block_token_budget=BUDGET, store_turns=False
    )
    app = create_app(config)
    with TestClient(app) as client:
        wait_ready(client)
        scheduler = app.state.scheduler
        assert scheduler.plans.get("alice").block is None  # nothing restored: every old child is stale
        r = client.post(
            "/v1/chat/completions",
            json={
                "model": app.state.backend.model_id,
                "user": "alice",
                "messages": [{"role": "user", "content": "Hi"}],
            },
        )
        cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        scheduler.flush()
        block = scheduler.plans.get("alice").block
        assert block is not None and block.item_id not in parents
        # alice is hot (seed's heat), so the scheduler builds the new knowledge item and her block under it as soon
        # as it starts: the chat is served as text (0), from the new knowledge item alone, or from her new block,
        # whichever build won the race; never from an old item (the old knowledge has another token count)
        new_parent = read_manifest(data / "kv", block.item_id)["meta"]["parent_id"]
        new_knowledge = read_manifest(data / "kv", new_parent)["meta"]["num_tokens"]
        old_knowledge = {read_manifest(data / "kv", p)["meta"]["num_tokens"] for p in set(parents.values())}
        old_blocks = {p.num_tokens for p in got["plans"].values()}
        assert not ({new_knowledge, block.num_tokens} & (old_knowledge | old_blocks))
        assert cached in (0, new_knowledge, block.num_tokens), (cached, new_knowledge, block.num_tokens)
        assert new_parent not in set(parents.values())
        assert scheduler.stats().prefills == 1

"""A backend that cannot build a block under an adapter (the fake one here, as vLLM): the scheduler keeps the
user's base-model block without the adapter's facts, the chat sends it as text (never its KV) under the adapter,
and the plan route says the block's K/V are the base model's. The server's own scheduler and chat path."""

from __future__ import annotations

from fastapi.testclient import TestClient

from kvmem.adapters import AdapterRegistry, FactRef, text_sha
from serving.backends.fake import FakeBackend
from tests.serving.conftest import ALICE, MODEL, make_stack

DOG, PORTO, TEA = "My dog is called Miso.", "I live in Porto.", "I like green tea."


def _save(directory) -> None:
    (directory / "adapter_model.safetensors").write_bytes(b"weights")
    (directory / "adapter_config.json").write_text("{}")


def test_without_builds_under_the_adapter_the_base_block_goes_as_text(tmp_path):
    s = make_stack(tmp_path)
    with TestClient(s.app) as client:
        ids = [s.store.add("alice", text=t)[0].id for t in (DOG, PORTO, TEA)]
        s.scheduler.flush()
        reg = AdapterRegistry(tmp_path / "adapters")
        m = reg.write(
            "alice",
            _save,
            base_fingerprint="x",
            facts=[FactRef(ids[0], 1, text_sha(DOG))],
            seed=0,
            passed=True,
        )
        reg.activate("alice", m.version)
        s.scheduler.get("alice")
        s.scheduler.flush()
        body = client.get("/v1/memories/plan", params={"user_id": "alice"}, headers=ALICE).json()
        assert body["adapter"]["memory_ids"] == [ids[0]]
        assert sorted(body["block"]["memory_ids"]) == sorted(ids[1:]) and body["block"]["adapter"] is None
        r = client.post(
            "/v1/chat/completions",
            headers=ALICE,
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": "Where do I live?"}],
                "max_tokens": 2,
            },
        )
        assert r.status_code == 200, r.text
        used = {u["id"]: u["tier"] for u in r.json()["memory"]["used"]}
        assert used == {ids[0]: "lora", ids[1]: "text", ids[2]: "text"}
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    s.scheduler.stop()


def test_a_backend_that_applies_no_adapter_gets_plans_without_one_and_the_facts_stay_kv(tmp_path):
    backend = FakeBackend()
    backend.serves_adapters = False  # vLLM without --enable-lora, transformers without peft
    s = make_stack(tmp_path, backend=backend)
    with TestClient(s.app) as client:
        ids = [s.store.add("alice", text=t)[0].id for t in (DOG, PORTO, TEA)]
        reg = AdapterRegistry(tmp_path / "adapters")
        m = reg.write(
            "alice",
            _save,
            base_fingerprint="x",
            facts=[FactRef(ids[0], 1, text_sha(DOG))],
            seed=0,
            passed=True,
        )
        reg.activate("alice", m.version)
        s.scheduler.get("alice")
        s.scheduler.flush()
        body = client.get("/v1/memories/plan", params={"user_id": "alice"}, headers=ALICE).json()
        assert body["adapter"] is None and sorted(body["block"]["memory_ids"]) == sorted(ids)
        r = client.post(
            "/v1/chat/completions",
            headers=ALICE,
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": "Where do I live?"}],
                "max_tokens": 2,
            },
        )
        assert {u["id"]: u["tier"] for u in r.json()["memory"]["used"]} == dict.fromkeys(ids, "kv")
        assert backend.requests[-1].adapter_id is None
    s.scheduler.stop()

"""The parametric tier through the server on the tiny llama (transformers backend, the real scheduler, HTTP): a
user's active adapter is in their plan, its facts are left out of the prompt and listed as tier `lora`, its
requests compute exactly what the peft model computes while other requests stay exactly the base model's, no
other user gets it, a change or delete of a held memory stops it before the call returns, and corrupt or stale
versions are never served."""

from __future__ import annotations

import asyncio
import shutil

import pytest

peft = pytest.importorskip("peft")


from kvmem.adapters import FactRef, text_sha  # noqa: E402
from kvmem.adapters.manifest import WEIGHTS_FILE  # noqa: E402
from kvmem.kv import Sampling, generate  # noqa: E402
from serving.backends.base import GenerationRequest, SamplingParams, TokenDelta  # noqa: E402
from tests.serving.kvstack import load_backend, served  # noqa: E402
from tests.serving.lora_helpers import DOG, PORTO, TEA, random_lora, write_active  # noqa: E402


@pytest.fixture(scope="module")
def lora_model(tiny_handle):
    return random_lora(tiny_handle, seed=3)


async def _ids(backend, req):
    out = []
    async for item in backend.stream(req):
        if isinstance(item, TokenDelta):
            out.extend(item.token_ids)
    return out


def test_an_adapter_request_runs_as_peft_does_and_base_requests_stay_exact(
    tmp_path, tiny_model_dir, lora_model, tiny_handle
):
    backend = load_backend(tiny_model_dir, tmp_path)
    fp = backend.handle.fingerprint.digest
    _, m = write_active(tmp_path, "alice", lora_model, [FactRef("m1", 1, text_sha(DOG))], fp)
    prompt = backend.layout_prompt([], [], [{"role": "user", "content": "What is my dog called?"}])
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
    try:
        before = asyncio.run(_ids(backend, GenerationRequest("b0", "alice", prompt, None, greedy)))
        tuned = asyncio.run(
            _ids(backend, GenerationRequest("a", "alice", prompt, None, greedy, m.adapter_id))
        )
        after = asyncio.run(_ids(backend, GenerationRequest("b1", "alice", prompt, None, greedy)))
        stolen = asyncio.run(_ids(backend, GenerationRequest("x", "bob", prompt, None, greedy, m.adapter_id)))
    finally:
        asyncio.run(backend.aclose())
    stop = backend._eos
    reference = list(
        generate(lora_model, prompt.ids, sampling=Sampling(max_new_tokens=8), stop_token_ids=stop)
    )
    base = list(
        generate(tiny_handle.model, prompt.ids, sampling=Sampling(max_new_tokens=8), stop_token_ids=stop)
    )
    assert [t for t in tuned if t not in stop] == [t for t in reference if t not in stop]
    assert before == after == [t for t in base if t not in stop]
    assert tuned != before  # the adapter changes the answer
    assert stolen == before  # another user's adapter id runs the base model
    assert backend.adapters.loaded == (m.name.replace("/", "_").replace(".", "_"),)


def _used(reply: dict) -> dict[str, str]:
    return {u["id"]: u["tier"] for u in reply["memory"]["used"]}


def test_served_facts_leave_the_prompt_and_a_change_stops_the_adapter_before_it_returns(
    tmp_path, tiny_model_dir, lora_model
):
    backend = load_backend(tiny_model_dir, tmp_path)
    seen: list[GenerationRequest] = []
    stream = backend.stream

    def recording(req, is_disconnected=None):
        seen.append(req)
        return stream(req, is_disconnected)

    backend.stream = recording
    with served(tmp_path, backend) as s:
        dog, porto, tea = s.add("alice", DOG), s.add("alice", PORTO), s.add("alice", TEA)
        bob_dog = s.add("bob", DOG)
        facts = [FactRef(dog, 1, text_sha(DOG)), FactRef(porto, 1, text_sha(PORTO))]
        reg, m = write_active(tmp_path, "alice", lora_model, facts, backend.handle.fingerprint.digest)
        s.plans.flush()
        plan = s.client.get("/v1/memories/plan", params={"user_id": "alice"}).json()["adapter"]
        assert plan == {
            "id": m.adapter_id,
            "version": 1,
            "name": m.name,
            "memory_ids": [dog, porto],
            "trained_ids": [dog, porto],
            "tier": "lora",
        }
        assert s.client.get("/v1/memories/plan", params={"user_id": "bob"}).json()["adapter"] is None
        s.plans.flush()  # the block of the rest is built under the adapter (tests/serving/backends/test_lora_kv.py)
        block = s.plan("alice")
        assert (block["memory_ids"], block["adapter"]) == ([tea], m.name)
        reply = s.chat("alice", "What is my dog called and where do I live? Do I like tea?")
        used = _used(reply)
        assert (used[dog], used[porto]) == ("lora", "lora")
        assert used.get(tea) == "kv" and reply["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        [req] = seen[-1:]
        prompt = backend.handle.tokenizer.decode(req.prompt.ids)
        assert (
            "green tea" in prompt
            and "Miso" not in prompt
            and "Porto" not in prompt.split("<|im_start|>user")[0]
        )
        assert (req.adapter_id, req.block_item_id) == (m.adapter_id, block["item_id"])
        assert _used(s.chat("bob", "What is my dog called?")).get(bob_dog) in ("kv", "text")

        backup = shutil.copytree(reg.path_of(m), tmp_path / "backup")
        r = s.client.patch(f"/v1/memories/{dog}", json={"user_id": "alice", "text": "My dog is called Rex."})
        assert r.status_code == 200
        assert reg.active("alice") is None  # before the call returned
        assert not reg.path_of(m).exists() and reg.rollback("alice") is None  # erased, not only unserved
        assert backend.adapters.loaded == ()  # and out of the backend's slots before the call returned
        backend._loop.call(lambda: None)  # the model thread's next turn: its weights have left the model
        assert sorted(backend.adapters._peft.peft_config) == []
        assert s.client.get("/v1/memories/plan", params={"user_id": "alice"}).json()["adapter"] is None
        used = _used(s.chat("alice", "What is my dog called and where do I live?"))
        assert "lora" not in used.values() and used[dog] in ("kv", "text")

        # the version that holds the old text, restored from a backup and activated by hand, is not served
        shutil.copytree(backup, reg.path_of(m))
        assert reg.activate("alice", 1, backend.handle.fingerprint.digest).name == m.name
        assert s.client.get("/v1/memories/plan", params={"user_id": "alice"}).json()["adapter"] is None


def test_a_fact_the_adapter_did_not_fully_recall_stays_in_the_block_and_in_the_prompt(
    tmp_path, tiny_model_dir, lora_model
):
    backend = load_backend(tiny_model_dir, tmp_path)
    seen: list[GenerationRequest] = []
    stream = backend.stream

    def recording(req, is_disconnected=None):
        seen.append(req)
        return stream(req, is_disconnected)

    backend.stream = recording
    with served(tmp_path, backend) as s:
        dog, porto, tea = s.add("alice", DOG), s.add("alice", PORTO), s.add("alice", TEA)
        facts = [FactRef(dog, 1, text_sha(DOG)), FactRef(porto, 1, text_sha(PORTO))]
        fp = backend.handle.fingerprint.digest
        _, m = write_active(tmp_path, "alice", lora_model, facts, fp, served_ids=[dog])  # Porto not recalled
        s.plans.flush()
        plan = s.client.get("/v1/memories/plan", params={"user_id": "alice"}).json()["adapter"]
        assert (plan["memory_ids"], plan["trained_ids"]) == ([dog], [dog, porto])
        s.plans.flush()
        block = s.plan("alice")
        assert (sorted(block["memory_ids"]), block["adapter"]) == (sorted([porto, tea]), m.name)
        reply = s.chat("alice", "What is my dog called and where do I live?")
        assert _used(reply) == {dog: "lora", porto: "kv", tea: "kv"}
        [req] = seen[-1:]
        prompt = backend.handle.tokenizer.decode(req.prompt.ids)
        assert "Porto" in prompt and "green tea" in prompt and "Miso" not in prompt
        assert (req.adapter_id, req.block_item_id) == (m.adapter_id, block["item_id"])


def test_a_corrupt_adapter_is_not_served_and_its_facts_go_back_to_text(tmp_path, tiny_model_dir, lora_model):
    backend = load_backend(tiny_model_dir, tmp_path)
    with served(tmp_path, backend) as s:
        dog = s.add("alice", DOG)
        reg, m = write_active(
            tmp_path, "alice", lora_model, [FactRef(dog, 1, text_sha(DOG))], backend.handle.fingerprint.digest
        )
        weights = reg.path_of(m) / WEIGHTS_FILE
        data = bytearray(weights.read_bytes())
        data[-2] ^= 0x10
        weights.write_bytes(bytes(data))
        assert s.client.get("/v1/memories/plan", params={"user_id": "alice"}).json()["adapter"] is None
        assert _used(s.chat("alice", "What is my dog called?"))[dog] in ("kv", "text")
        assert backend.adapters.loaded == ()

        s.client.delete(f"/v1/memories/{dog}", params={"user_id": "alice"})
        assert reg.active("alice") is None  # the delete cascade reached the (unserved) pointer too


def test_a_superseded_fact_stops_the_adapter_before_the_call_returns(tmp_path, tiny_model_dir, lora_model):
    """Supersession (memory formation: a newer fact about the same slot) cascades like an update: the adapter
    holding the old fact is erased before the call returns, and the old fact is served in no tier."""
    backend = load_backend(tiny_model_dir, tmp_path)
    with served(tmp_path, backend) as s:
        dog, porto = s.add("alice", DOG), s.add("alice", PORTO)
        facts = [FactRef(dog, 1, text_sha(DOG)), FactRef(porto, 1, text_sha(PORTO))]
        reg, m = write_active(tmp_path, "alice", lora_model, facts, backend.handle.fingerprint.digest)
        s.plans.flush()
        assert (
            s.client.get("/v1/memories/plan", params={"user_id": "alice"}).json()["adapter"]["id"]
            == m.adapter_id
        )
        rex = s.add("alice", "My dog is called Rex.")
        s.store.supersede("alice", dog, rex)
        assert reg.active("alice") is None and not reg.path_of(m).exists()  # before supersede returned
        assert backend.adapters.loaded == ()
        s.plans.flush()
        assert s.client.get("/v1/memories/plan", params={"user_id": "alice"}).json()["adapter"] is None
        used = _used(s.chat("alice", "What is my dog called and where do I live?"))
        assert dog not in used and "lora" not in used.values() and used[rex] in ("kv", "text")

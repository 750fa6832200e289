"""The user's KV block under their LoRA adapter, on the tiny llama through the server: the block of the memories
the adapter does not hold is built with the adapter on (its content address and fingerprint name the adapter),
it is injected only under that adapter version, and the tokens equal the same request's full prefill under
the adapter; a base-model block is never injected under the adapter, nor the reverse; a change of a memory
the adapter holds stops the adapter and its block before the call returns."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

peft = pytest.importorskip("peft")


from kvmem.adapters import FactRef, text_sha  # noqa: E402
from kvmem.kv import Sampling, generate  # noqa: E402
from serving.backends.base import (  # noqa: E402
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    TokenDelta,
)
from tests.serving.kvstack import load_backend, served  # noqa: E402
from tests.serving.lora_helpers import DOG, PORTO, TEA, random_lora, write_active  # noqa: E402

GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0)


@pytest.fixture(scope="module")
def lora_model(tiny_handle):
    return random_lora(tiny_handle, seed=5)


async def _run(backend, req):
    ids, result = [], None
    async for item in backend.stream(req):
        if isinstance(item, TokenDelta):
            ids.extend(item.token_ids)
        elif isinstance(item, GenerationResult):
            result = item
    return ids, result


def _item_fingerprint(data_dir, item_id) -> dict:
    [path] = list((data_dir / "kv").rglob(f"{item_id}*.json"))
    return json.loads(path.read_text())["meta"]["fingerprint"]


def test_the_block_is_built_under_the_adapter_and_serves_its_exact_tokens(
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
        s.plans.flush()
        base_block = s.plan("alice")
        assert set(base_block["memory_ids"]) == {dog, porto, tea} and base_block["adapter"] is None
        fp = backend.handle.fingerprint
        _, m = write_active(tmp_path, "alice", lora_model, [FactRef(dog, 1, text_sha(DOG))], fp.digest)
        # the first read after activation does not serve the base block; the refresh builds it under the adapter
        assert s.plans.get("alice").block is None
        s.plans.flush()
        body = s.client.get("/v1/memories/plan", params={"user_id": "alice"}).json()
        block, adapter = body["block"], body["adapter"]
        assert (adapter["name"], adapter["memory_ids"]) == (m.name, [dog])
        assert sorted(block["memory_ids"]) == sorted([porto, tea]) and block["adapter"] == m.name
        assert not backend.has_block(base_block["item_id"])  # the base block was replaced, not kept beside
        assert _item_fingerprint(tmp_path, block["item_id"]) == fp.under(m.name).to_dict()
        plan = s.plans.get("alice")
        expected_id, _ = backend.builder.block_item_id(
            "alice", plan.block.texts, plan.block.memory_ids, m.name
        )
        base_id, _ = backend.builder.block_item_id("alice", plan.block.texts, plan.block.memory_ids)
        assert block["item_id"] == expected_id != base_id

        reply = s.chat("alice", "What is my dog called?")
        used = {u["id"]: u["tier"] for u in reply["memory"]["used"]}
        assert used == {dog: "lora", porto: "kv", tea: "kv"}
        [req] = seen[-1:]
        assert (req.adapter_id, req.block_item_id) == (m.adapter_id, block["item_id"])
        assert (
            reply["usage"]["prompt_tokens_details"]["cached_tokens"]
            == req.prompt.block_len
            == block["tokens"]
        )

        # exactness: the injected block under the adapter == full prefill of the same prompt under the adapter
        backend.pool.prefix.drop_user(
            "alice"
        )  # from the block alone, not the chat's pages the prefix cache kept
        greedy = GenerationRequest("i", "alice", req.prompt, req.block_item_id, GREEDY, m.adapter_id)
        injected, r_inj = asyncio.run(_run(backend, greedy))
        cold, r_cold = asyncio.run(
            _run(backend, GenerationRequest("c", "alice", req.prompt, None, GREEDY, m.adapter_id))
        )
        assert (r_inj.cached_tokens, r_inj.kv_fallback_reason) == (req.prompt.block_len, None)
        assert r_cold.cached_tokens == 0
        assert injected == cold and len(injected) > 0
        reference = list(generate(lora_model, req.prompt.ids, sampling=Sampling(max_new_tokens=8)))
        assert injected == [t for t in reference if t not in backend._eos]

        # a base-model item of the same texts is never injected under the adapter, nor the adapter's without it
        base = backend.build_block("alice", list(plan.block.texts), list(plan.block.memory_ids))
        assert base.item_id == base_id
        crossed, r_crossed = asyncio.run(
            _run(backend, GenerationRequest("x", "alice", req.prompt, base.item_id, GREEDY, m.adapter_id))
        )
        assert (crossed, r_crossed.kv_fallback_reason, r_crossed.cached_tokens) == (
            cold,
            "fingerprint_mismatch",
            0,
        )
        plain, r_plain = asyncio.run(
            _run(backend, GenerationRequest("p", "alice", req.prompt, block["item_id"], GREEDY))
        )
        base_cold, _ = asyncio.run(_run(backend, GenerationRequest("q", "alice", req.prompt, None, GREEDY)))
        assert (plain, r_plain.kv_fallback_reason, r_plain.cached_tokens) == (
            base_cold,
            "fingerprint_mismatch",
            0,
        )
        assert base_cold != cold  # the adapter changes the answer: the comparison above can fail


@pytest.mark.parametrize("change", ["patch", "delete"])
def test_a_change_of_a_held_memory_stops_the_adapter_and_its_block_before_it_returns(
    tmp_path, tiny_model_dir, lora_model, change
):
    backend = load_backend(tiny_model_dir, tmp_path)
    with served(tmp_path, backend) as s:
        dog, porto, tea = s.add("alice", DOG), s.add("alice", PORTO), s.add("alice", TEA)
        fp = backend.handle.fingerprint.digest
        # v1: an earlier version holding the dog (a rollback could bring it back), with a block built under it;
        # v2: tea only, never served; v3: the served one, holding the dog
        reg, v1 = write_active(tmp_path, "alice", lora_model, [FactRef(dog, 1, text_sha(DOG))], fp)
        # not in the order the scheduler lays them out ([porto, tea]: its own block under v1, dropped once v3
        # is served), so this block is another item, left stored until the change's cascade
        old_block = backend.build_block("alice", [TEA, PORTO], [tea, porto], adapter_id=v1.adapter_id)
        v2 = reg.write(
            "alice",
            lambda d: lora_model.save_pretrained(str(d), safe_serialization=True),
            base_fingerprint=fp,
            facts=[FactRef(tea, 1, text_sha(TEA))],
            seed=0,
            passed=True,
        )
        _, m = write_active(
            tmp_path,
            "alice",
            lora_model,
            [FactRef(dog, 1, text_sha(DOG)), FactRef(tea, 1, text_sha(TEA))],
            fp,
        )
        s.plans.get("alice")
        s.plans.flush()
        block = s.plan("alice")
        assert (block["memory_ids"], block["adapter"]) == ([porto], m.name)
        assert backend.has_block(old_block.item_id) and m.version == 3

        if change == "patch":
            r = s.client.patch(
                f"/v1/memories/{dog}", json={"user_id": "alice", "text": "My dog is called Rex."}
            )
        else:
            r = s.client.delete(f"/v1/memories/{dog}", params={"user_id": "alice"})
        assert r.status_code == 200
        # before the call returned: the adapter is off and the block built under it is gone
        assert reg.active("alice") is None
        body = s.client.get("/v1/memories/plan", params={"user_id": "alice"}).json()
        # (the worker thread may have rebuilt the base-model block already: never the adapter's)
        assert body["adapter"] is None and (body["block"] is None or body["block"]["adapter"] is None)
        assert not backend.has_block(block["item_id"])
        # and erased: every version holding the old text and every block built under one, files included
        assert [v.version for v in reg.versions("alice")] == [v2.version]
        assert not reg.path_of(v1).exists() and not reg.path_of(m).exists() and reg.path_of(v2).exists()
        assert not backend.has_block(old_block.item_id)
        assert not list((tmp_path / "kv").rglob(f"{old_block.item_id}*"))
        assert reg.rollback("alice", fp) is None  # nothing holding the dog can be served again
        s.plans.flush()
        rebuilt = s.plan("alice")
        live = [dog, porto, tea] if change == "patch" else [porto, tea]
        assert sorted(rebuilt["memory_ids"]) == sorted(live) and rebuilt["adapter"] is None
        assert _item_fingerprint(tmp_path, rebuilt["item_id"]) == backend.handle.fingerprint.to_dict()
        used = {u["id"]: u["tier"] for u in s.chat("alice", "What is my dog called?")["memory"]["used"]}
        assert used == dict.fromkeys(live, "kv")


def test_a_new_adapter_version_gets_its_own_block(tmp_path, tiny_model_dir, lora_model):
    backend = load_backend(tiny_model_dir, tmp_path)
    with served(tmp_path, backend) as s:
        dog, porto, tea = s.add("alice", DOG), s.add("alice", PORTO), s.add("alice", TEA)
        fp = backend.handle.fingerprint.digest
        reg, v1 = write_active(tmp_path, "alice", lora_model, [FactRef(dog, 1, text_sha(DOG))], fp)
        s.plans.get("alice")
        s.plans.flush()
        first = s.plan("alice")
        assert (sorted(first["memory_ids"]), first["adapter"]) == (sorted([porto, tea]), v1.name)
        _, v2 = write_active(
            tmp_path,
            "alice",
            lora_model,
            [FactRef(dog, 1, text_sha(DOG)), FactRef(tea, 1, text_sha(TEA))],
            fp,
        )
        assert s.plans.get("alice").block is None  # v1's block is not served under v2
        s.plans.flush()
        second = s.plan("alice")
        assert (second["memory_ids"], second["adapter"]) == ([porto], v2.name)
        assert not backend.has_block(first["item_id"])
        assert _item_fingerprint(tmp_path, second["item_id"])["adapter"] == v2.name
        assert v1.name != v2.name


def test_a_tags_only_change_keeps_the_block_and_the_adapter(tmp_path, tiny_model_dir, lora_model):
    backend = load_backend(tiny_model_dir, tmp_path)
    with served(tmp_path, backend) as s:
        dog, porto, tea = s.add("alice", DOG), s.add("alice", PORTO), s.add("alice", TEA)
        reg, m = write_active(
            tmp_path, "alice", lora_model, [FactRef(dog, 1, text_sha(DOG))], backend.handle.fingerprint.digest
        )
        s.plans.get("alice")
        s.plans.flush()
        block = s.plan("alice")
        assert (sorted(block["memory_ids"]), block["adapter"]) == (sorted([porto, tea]), m.name)
        for memory_id in (porto, dog):  # one in the block, one the adapter holds
            r = s.client.patch(f"/v1/memories/{memory_id}", json={"user_id": "alice", "tags": ["kept"]})
            assert (r.status_code, r.json()["version"], r.json()["tags"]) == (200, 2, ["kept"])
            assert s.plan("alice")["item_id"] == block["item_id"] and backend.has_block(block["item_id"])
            assert reg.active("alice").version == 1
        s.plans.flush()
        body = s.client.get("/v1/memories/plan", params={"user_id": "alice"}).json()
        assert (body["block"]["item_id"], body["adapter"]["name"]) == (block["item_id"], m.name)

        # a text change is a change: the block stops being served before the call returns (the test can fail)
        r = s.client.patch(f"/v1/memories/{porto}", json={"user_id": "alice", "text": "I live in Braga."})
        assert r.status_code == 200 and not backend.has_block(block["item_id"])
        assert reg.active("alice").version == 1  # the adapter does not hold that memory


def test_deleting_all_of_a_users_memories_erases_every_adapter_version_and_block_under_one(
    tmp_path, tiny_model_dir, lora_model
):
    backend = load_backend(tiny_model_dir, tmp_path)
    with served(tmp_path, backend) as s:
        dog, porto, bob_dog = s.add("alice", DOG), s.add("alice", PORTO), s.add("bob", DOG)
        fp = backend.handle.fingerprint.digest
        reg, v1 = write_active(tmp_path, "alice", lora_model, [FactRef(dog, 1, text_sha(DOG))], fp)
        under_v1 = backend.build_block("alice", [PORTO], [porto], adapter_id=v1.adapter_id)
        _, v2 = write_active(tmp_path, "alice", lora_model, [FactRef(porto, 1, text_sha(PORTO))], fp)
        _, bobs = write_active(tmp_path, "bob", lora_model, [FactRef(bob_dog, 1, text_sha(DOG))], fp)
        bob_block = backend.build_block("bob", [], [], adapter_id=bobs.adapter_id)
        r = s.client.delete("/v1/memories", params={"user_id": "alice"})
        assert r.json() == {"deleted": 2}
        assert reg.versions("alice") == [] and reg.active("alice") is None
        assert not reg.path_of(v1).exists() and not reg.path_of(v2).exists()
        assert not backend.has_block(under_v1.item_id)
        assert [m.version for m in reg.versions("bob")] == [1] and reg.active("bob").name == bobs.name
        assert backend.has_block(bob_block.item_id)


def test_a_block_under_an_adapter_is_built_in_the_engines_chunked_steps(tmp_path, tiny_model_dir, lora_model):
    """A build under a LoRA adapter is a prefill in the engine's steps, as a request under it is: in chunks
    (here 16 tokens, nothing else running), its tokens under the adapter's delta. Its K/V equal the per-request
    path's (the whole block prefilled at once with the adapter's layers on) to float32 rounding, the adapter is
    held while it runs and released after, and its pages go back."""
    import torch

    from kvmem.kv import build_item

    backend = load_backend(tiny_model_dir, tmp_path, prefill_chunk_tokens=16)
    try:
        fp = backend.handle.fingerprint
        _, m = write_active(tmp_path, "alice", lora_model, [FactRef("dog", 1, text_sha(DOG))], fp.digest)
        reads: list[str] = []  # the threads that read and hash the adapter's weights: never the model's
        real_load = backend.adapters.registry.load
        backend.adapters.registry.load = lambda *a: (
            reads.append(threading.current_thread().name) or real_load(*a)
        )
        shapes: list[tuple[int, ...]] = []
        hook = backend.handle.model.register_forward_pre_hook(
            lambda _m, _a, kw: shapes.append(tuple(kw["input_ids"].shape)), with_kwargs=True
        )
        try:
            built = backend.build_block("alice", [PORTO, TEA], ["porto", "tea"], adapter_id=m.adapter_id)
        finally:
            hook.remove()
        assert len(reads) == 1 and reads[0].startswith("kvmem-io")
        n = built.num_tokens
        assert n > 32 and shapes == [(1, 16)] * (n // 16) + ([(1, n % 16)] if n % 16 else [])
        item = backend.store.get(built.item_id)
        assert item.meta.fingerprint == fp.under(m.name) and item.meta.parent_id is None
        [name] = [k for k, v in backend.adapters.served.items() if v == m.name]
        reference = backend._loop.call(
            lambda: backend.adapters.run(
                name, lambda: build_item(backend.handle, item.token_ids, user_id="a")
            )
        )
        base = backend._loop.call(lambda: build_item(backend.handle, item.token_ids, user_id="a"))
        assert torch.allclose(item.kv, reference.kv, atol=1e-5, rtol=1e-4)
        assert not torch.allclose(
            item.kv, base.kv, atol=1e-3
        )  # the adapter changed the K/V: the check can fail
        assert backend._loop.call(lambda: backend.adapters._in_use.get(name, 0)) == 0
        assert backend.pool.used_pages == backend.pool.shared.page_count()
        # a request under another version: its weights are read off the model thread (and off the event
        # loop's) too, before its first step
        _, bobs = write_active(tmp_path, "bob", lora_model, [FactRef("tea", 1, text_sha(TEA))], fp.digest)
        prompt = backend.layout_prompt([], [], [{"role": "user", "content": "Hi"}])
        ids, result = asyncio.run(
            _run(backend, GenerationRequest("b", "bob", prompt, None, GREEDY, bobs.adapter_id))
        )
        assert len(ids) > 0 and len(reads) == 2 and reads[1] not in ("kvmem-model", "MainThread")
    finally:
        asyncio.run(backend.aclose())

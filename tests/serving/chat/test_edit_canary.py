"""An edit's canary is never answered from the old block after the edit returns (issue 44): a memory holding a
unique code is changed by PATCH again and again, and the chat sent right after each PATCH returned, before the
scheduler rebuilt the block, and after, is checked against what the backend was actually handed: the prompt ids
never carry a replaced code, and a block it injects is the item whose tokens are that prompt's block tokens.
The real server: HTTP app, scheduler with its worker thread, the transformers backend over the tiny llama (its
greedy words mean nothing, so the prompt, not the answer, is what is checked)."""

from __future__ import annotations

import threading
from typing import Any

from kvmem.errors import KVItemNotFound
from kvmem.kv.item import tokens_sha
from serving.backends.transformers.backend import TransformersBackend, TransformersBackendConfig
from tests.serving.kvstack import served

CODES = ("PLUM-4821-OTTER", "CEDAR-1937-RAVEN", "QUARTZ-5260-MAPLE", "EMBER-7702-TULIP", "COBALT-3318-FJORD")


class RecordingBackend(TransformersBackend):
    """The transformers backend, unchanged, that keeps every request it is asked to stream."""

    def __init__(self, config: TransformersBackendConfig) -> None:
        super().__init__(config)
        self.requests: list[Any] = []
        self.block_metas: dict[str, Any] = {}  # each block asked for, as stored then (a rebuild may drop it)

    def stream(self, request, *args, **kwargs):
        self.requests.append(request)
        if request.block_item_id is not None:
            try:
                self.block_metas[request.block_item_id] = self.store.meta(request.block_item_id)
            except KVItemNotFound:  # dropped since it was prepared (a cut the rebuild replaced)
                pass
        return super().stream(request, *args, **kwargs)


def secret(code: str) -> str:
    return f"My secret code is {code}."


def served_codes(backend: RecordingBackend, request) -> tuple[set[str], set[str]]:
    """The codes the request's prompt carries, and those its injected block carries (empty: no block)."""
    tok = backend.handle.tokenizer
    prompt = tok.decode(list(request.prompt.ids))
    block_ids = list(request.prompt.ids[: request.prompt.block_len])
    in_block: set[str] = set()
    if request.block_item_id in backend.block_metas:  # else dropped before it streamed: prefilled as text
        meta = backend.block_metas[request.block_item_id]
        # the K/V injected were computed from exactly these tokens (the item is content-addressed by them)
        assert meta.tokens_sha == tokens_sha(block_ids)
        in_block = {c for c in CODES if c in tok.decode(block_ids)}
    return {c for c in CODES if c in prompt}, in_block


def test_an_edits_canary_is_never_answered_from_the_old_block(tmp_path, tiny_model_dir):
    backend = RecordingBackend(TransformersBackendConfig(model=str(tiny_model_dir), data_dir=str(tmp_path)))
    backend.load()
    with served(tmp_path, backend) as s:
        s.add("alice", "I live in Lisbon and cycle to work.")
        s.add("alice", "My sister plays the violin in an orchestra.")
        canary = s.add("alice", secret(CODES[0]))
        s.plans.flush()
        assert canary in s.plan("alice")["memory_ids"]
        out = s.chat("alice", "What is my secret code?")
        assert {"id": canary, "tier": "kv"} in out["memory"]["used"]
        assert served_codes(backend, backend.requests[-1]) == (
            {CODES[0]},
            {CODES[0]},
        )  # the check sees a code

        served_from_kv = 0
        for k, code in enumerate(CODES[1:], start=1):
            r = s.client.patch(f"/v1/memories/{canary}", json={"user_id": "alice", "text": secret(code)})
            assert r.status_code == 200, r.text
            assert r.json()["text"] == secret(code)
            # at once, while the scheduler's worker may still be building the new block: a prompt of another
            # length each time (the question grows)
            s.chat("alice", "What is my secret code?" + " Please." * k)
            prompt_codes, block_codes = served_codes(backend, backend.requests[-1])
            # the new code only; no block (the edit withdrew it: its memories go in as text), or the new one
            assert prompt_codes == {code} and block_codes <= {code}
            s.plans.flush()  # the new block is built: served from KV again, with the new code only
            out = s.chat("alice", "And my code again?")
            assert served_codes(backend, backend.requests[-1]) == ({code}, {code})
            assert {"id": canary, "tier": "kv"} in out["memory"]["used"]
            served_from_kv += 1
        assert served_from_kv == len(CODES) - 1
        # each chat handed to the backend, and a chat whose block (a change's cut) the rebuild dropped after it was
        # prepared handed again, prepared anew
        assert len(backend.requests) >= 1 + 2 * (len(CODES) - 1)


def test_an_edit_late_in_the_block_keeps_what_comes_before_it_served_from_kv(tmp_path, tiny_model_dir):
    """The canary is the block's last memory: its PATCH cuts the block before it (no prefill), so the chat sent
    at once injects the cut (the two other memories, no code) with the new code as text; the rebuild then
    prefills over the cut (its K/V are the new block's first tokens' bit for bit) and deletes it."""
    import torch

    backend = RecordingBackend(TransformersBackendConfig(model=str(tiny_model_dir), data_dir=str(tmp_path)))
    backend.load()
    with served(tmp_path, backend) as s:
        kept = []
        for text in ("I live in Lisbon and cycle to work.", "My sister plays the violin in an orchestra."):
            kept.append(s.add("alice", text))
            s.plans.flush()  # appended one at a time: the block's order is the adds' order
        canary = s.add("alice", secret(CODES[0]))
        s.plans.flush()
        assert s.plan("alice")["memory_ids"] == [*kept, canary]
        whole = s.plans.get("alice").block.item_id
        gate, real_build = threading.Event(), s.plans.builder.build_block
        s.plans.builder.build_block = lambda *a, **k: gate.wait(60) and real_build(*a, **k)  # held
        r = s.client.patch(f"/v1/memories/{canary}", json={"user_id": "alice", "text": secret(CODES[1])})
        assert r.status_code == 200, r.text
        cut = s.plans.get("alice").block  # published before the PATCH returned
        assert cut.memory_ids == tuple(kept) and not backend.has_block(whole) and s.plans.stats().cuts == 1
        out = s.chat("alice", "What is my secret code?")
        request = backend.requests[-1]
        assert request.block_item_id == cut.item_id
        assert served_codes(backend, request) == ({CODES[1]}, set())
        tiers = {u["id"]: u["tier"] for u in out["memory"]["used"]}
        assert tiers == {kept[0]: "kv", kept[1]: "kv", canary: "text"}
        before = backend.store.get(cut.item_id)
        gate.set()
        s.plans.flush()
        block = s.plans.get("alice").block
        assert block.memory_ids == (*kept, canary)
        item = backend.store.get(block.item_id)
        n = before.num_tokens
        assert torch.equal(item.kv_range(0, n), before.kv_range(0, n))
        assert not backend.has_block(cut.item_id)
        metrics = s.client.get("/metrics").text
        assert "kvmem_scheduler_block_cuts_total 1" in metrics

"""An edit's canary is never answered from the old block after the edit returns (issue 44): a memory holding a
unique code is changed by PATCH again and again, and the chat sent right after each PATCH returned, before the
scheduler rebuilt the block, and after, is checked against what the backend was actually handed: the prompt ids
never carry a replaced code, and a block it injects is the item whose tokens are that prompt's block tokens.
The real server: HTTP app, scheduler with its worker thread, the transformers backend over the tiny llama (its
greedy words mean nothing, so the prompt, not the answer, is what is checked)."""

from __future__ import annotations

from typing import Any

from kvmem.kv.item import tokens_sha
from serving.backends.transformers.backend import TransformersBackend, TransformersBackendConfig
from tests.serving.kvstack import served

CODES = ("PLUM-4821-OTTER", "CEDAR-1937-RAVEN", "QUARTZ-5260-MAPLE", "EMBER-7702-TULIP", "COBALT-3318-FJORD")


class RecordingBackend(TransformersBackend):
    """The transformers backend, unchanged, that keeps every request it is asked to stream."""

    def __init__(self, config: TransformersBackendConfig) -> None:
        super().__init__(config)
        self.requests: list[Any] = []

    def stream(self, request, *args, **kwargs):
        self.requests.append(request)
        return super().stream(request, *args, **kwargs)


def secret(code: str) -> str:
    return f"My secret code is {code}."


def served_codes(backend: RecordingBackend, request) -> tuple[set[str], set[str]]:
    """The codes the request's prompt carries, and those its injected block carries (empty: no block)."""
    tok = backend.handle.tokenizer
    prompt = tok.decode(list(request.prompt.ids))
    block_ids = list(request.prompt.ids[: request.prompt.block_len])
    in_block: set[str] = set()
    if request.block_item_id is not None:
        item = backend.store.get(request.block_item_id)
        # the K/V injected were computed from exactly these tokens (the item is content-addressed by them)
        assert item.meta.tokens_sha == tokens_sha(block_ids)
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
        assert len(backend.requests) == 1 + 2 * (len(CODES) - 1)

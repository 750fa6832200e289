"""Shared knowledge on the vLLM backend (issue 16), real vLLM (CPU, fp32, eager) and the real default model:
[knowledge][user memories][query] served with the block injected through the KV connector (the knowledge
part from the shared knowledge item, the user's own part from their child item: `KVItem.kv_range`) under the
user's cache salt gives the greedy tokens of a full prefill; another user naming the item is refused."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("vllm")

from kvmem.kv import Sampling, generate, knowledge  # noqa: E402
from kvmem.kv.knowledge import knowledge_item_id  # noqa: E402
from serving.backends.base import GenerationRequest, SamplingParams, TokenDelta  # noqa: E402
from serving.backends.vllm.backend import VllmBackend, VllmBackendConfig  # noqa: E402
from tests.conftest import synthetic_memories  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

QUESTION = [{"role": "user", "content": "When does the shop open, and where do I live?"}]
GREEDY = SamplingParams(max_new_tokens=24, temperature=0.0)
FAQ = [
    "The shop opens at 9am and closes at 6pm, Monday to Saturday.",
    "Returns are accepted within 30 days with a receipt; sale items within 14 days.",
    "Shipping to Portugal takes three working days; to Spain, four.",
    "Gift cards never expire and can be used online or in the shop.",
]


async def _run(backend, req):
    ids, result = [], None
    async for out in backend.stream(req):
        if isinstance(out, TokenDelta):
            ids.extend(out.token_ids)
        else:
            result = out
    return ids, result


def run(backend, user, prompt, item_id):
    return asyncio.run(
        _run(backend, GenerationRequest(f"req-{user}-{item_id}", user, prompt, item_id, GREEDY))
    )


def test_vllm_serves_knowledge_then_user_memories_with_full_prefill_tokens(tmp_path, default_model_dir):
    knowledge.install(tmp_path, FAQ)
    vb = VllmBackend(
        VllmBackendConfig(model=str(default_model_dir), data_dir=str(tmp_path), max_queue=2, host_kv_bytes=0)
    )
    vb.load()
    try:
        k = len(vb.layout.knowledge_ids)
        assert k > 0
        memories = ["I live in Lisbon.", *synthetic_memories(120, vb.handle.tokenizer, seed=5)]
        built = vb.build_block("alice", memories)
        meta = vb.store.meta(built.item_id)
        assert (meta.parent_id, meta.parent_tokens) == (
            knowledge_item_id(vb.layout, vb.handle.fingerprint),
            k,
        )
        assert built.shared_tokens == k and built.num_bytes == meta.stored_bytes < meta.num_bytes
        prompt = vb.layout_prompt(memories, [], QUESTION, built.token_ids)
        assert prompt.block_len == built.num_tokens > k

        assert vb.reset_prefix_cache()
        injected = run(vb, "alice", prompt, built.item_id)  # the whole block through the connector
        assert vb.reset_prefix_cache()
        cold = run(vb, "cold-user", prompt, None)  # vLLM prefills everything
        full = list(
            generate(
                vb.handle.model, prompt.ids, sampling=Sampling(max_new_tokens=24), stop_token_ids=vb._eos
            )
        )  # transformers, full prefill, no item
        assert injected[0] == cold[0] == full and len(full) > 0
        assert (injected[1].cached_tokens, injected[1].kv_fallback_reason) == (prompt.block_len, None)
        assert cold[1].cached_tokens == 0
        # the user's item is the user's: another user naming it is refused (full prefill, same tokens)
        other = run(vb, "bob", prompt, built.item_id)
        assert (other[1].kv_fallback_reason, other[1].cached_tokens, other[0]) == ("wrong_user", 0, full)
    finally:
        asyncio.run(vb.aclose())

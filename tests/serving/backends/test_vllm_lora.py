"""The vLLM backend with LoRA on (real vLLM, CPU fp32, the default model; its own engine), over a registry
version of a user's adapter: the request goes in as a LoRARequest named by version and hash; the user's block
built under the adapter (peft on the builder's transformers copy) is injected under that adapter only, and its
greedy tokens equal vLLM's own cold prefill under the LoRA and peft's full prefill over the same ids; a base
model's block is never injected under the adapter, nor the adapter's block without it; another user cannot
name the adapter.

Needs peft (`pip install 'kvmem[lora]'`); skipped without it."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("vllm")
peft = pytest.importorskip("peft")

from kvmem.adapters import FactRef, text_sha  # noqa: E402
from kvmem.kv import Sampling, generate  # noqa: E402
from serving.backends.base import GenerationRequest, SamplingParams, TokenDelta  # noqa: E402
from serving.backends.vllm.backend import VllmBackend, VllmBackendConfig  # noqa: E402
from tests.serving.lora_helpers import random_lora, write_active  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

MEMORIES = ["I live in Lisbon with my sister.", "My dog is a golden retriever called Miso."]
QUESTION = [{"role": "user", "content": "What is my dog called?"}]
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0)


async def _run(backend, req):
    ids, result = [], None
    async for item in backend.stream(req):
        if isinstance(item, TokenDelta):
            ids.extend(item.token_ids)
        else:
            result = item
    return ids, result


def _item_fingerprint(data_dir, item_id) -> dict:
    [path] = list((data_dir / "kv").rglob(f"{item_id}*.json"))
    return json.loads(path.read_text())["meta"]["fingerprint"]


def test_the_block_under_the_adapter_is_injected_under_it_only_and_gives_peft_tokens(
    tmp_path, default_model_dir, default_handle
):
    tuned = random_lora(default_handle, seed=3)
    fp = default_handle.fingerprint.digest
    _, m = write_active(tmp_path, "u", tuned, [FactRef("m-dog", 1, text_sha(MEMORIES[1]))], fp)
    backend = VllmBackend(
        VllmBackendConfig(model=str(default_model_dir), data_dir=str(tmp_path), enable_lora=True)
    )
    backend.load()
    try:
        assert backend.builds_under_adapter
        base_block = backend.build_block("u", MEMORIES)
        block = backend.build_block("u", MEMORIES, adapter_id=m.adapter_id)
        assert block.item_id != base_block.item_id and block.token_ids == base_block.token_ids
        assert _item_fingerprint(tmp_path, block.item_id)["adapter"] == m.name
        assert "adapter" not in _item_fingerprint(tmp_path, base_block.item_id)
        prompt = backend.layout_prompt(MEMORIES, [], QUESTION, block.token_ids)

        def run(request_id, item_id, adapter_id=None):
            req = GenerationRequest(request_id, "u", prompt, item_id, GREEDY, adapter_id=adapter_id)
            return asyncio.run(_run(backend, req))

        base = run("base", base_block.item_id)
        injected = run("injected", block.item_id, m.adapter_id)
        crossed = run("crossed", base_block.item_id, m.adapter_id)  # the base model's K/V under the adapter
        reverse = run("reverse", block.item_id)  # the adapter's K/V without it
        backend.reset_prefix_cache()
        cold = run("cold", None, m.adapter_id)  # vLLM's own prefill of the whole prompt under the LoRA
        assert backend._lora("v", m.adapter_id) is None  # another user cannot name it
    finally:
        asyncio.run(backend.aclose())
    reference = list(
        generate(tuned, prompt.ids, sampling=Sampling(max_new_tokens=12), stop_token_ids=backend._eos)
    )
    assert (base[1].cached_tokens, base[1].kv_fallback_reason) == (prompt.block_len, None)
    assert (injected[1].cached_tokens, injected[1].kv_fallback_reason) == (prompt.block_len, None)
    assert (crossed[1].cached_tokens, crossed[1].kv_fallback_reason) == (0, "fingerprint_mismatch")
    assert (reverse[1].cached_tokens, reverse[1].kv_fallback_reason) == (0, "fingerprint_mismatch")
    assert cold[1].cached_tokens == 0
    assert injected[0] == cold[0] == crossed[0] == reference
    assert (
        reverse[0] == base[0] and base[0] != reference
    )  # the adapter changes the answer: a test that can fail


def test_kvmem_serve_vllm_enable_lora_serves_the_adapter_and_its_block_and_delete_erases_both(
    tmp_path, default_model_dir, default_handle
):
    """`kvmem serve --backend vllm --enable-lora` as users start it: an active registry version is served as a
    LoRA with the block of the rest built under it (cached tokens > 0), and a DELETE of a memory the adapter
    holds stops it and erases its files and its block before the call returns."""
    import time
    import urllib.request

    from benchmarks.load.http_client import _get, _post, spawned_server

    data = tmp_path / "data"
    with spawned_server(
        backend="vllm",
        model=str(default_model_dir),
        block_budget=2048,
        top_k=4,
        data_dir=str(data),
        extra=("--enable-lora",),
    ) as base:
        lisbon, dog = (
            _post(f"{base}/v1/memories", {"user_id": "frank", "text": t})["memories"][0]["id"]
            for t in MEMORIES
        )
        fp = default_handle.fingerprint.digest
        reg, m = write_active(
            data, "frank", random_lora(default_handle, seed=3), [FactRef(dog, 1, text_sha(MEMORIES[1]))], fp
        )
        deadline, plan = time.monotonic() + 300, None
        while time.monotonic() < deadline:  # each read of the plan sees the new adapter; a refresh rebuilds
            plan = _get(f"{base}/v1/memories/plan?user_id=frank")
            if plan["block"] is not None and plan["block"]["adapter"] == m.name:
                break
            time.sleep(0.25)
        assert plan["adapter"]["name"] == m.name and plan["adapter"]["memory_ids"] == [dog]
        assert plan["block"]["memory_ids"] == [lisbon]
        body = {
            "model": str(default_model_dir),
            "user": "frank",
            "messages": QUESTION,
            "max_tokens": 8,
            "temperature": 0,
        }
        reply = _post(f"{base}/v1/chat/completions", body)
        assert {u["id"]: u["tier"] for u in reply["memory"]["used"]} == {dog: "lora", lisbon: "kv"}
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == plan["block"]["tokens"] > 0

        request = urllib.request.Request(f"{base}/v1/memories/{dog}?user_id=frank", method="DELETE")
        with urllib.request.urlopen(request, timeout=60) as r:  # noqa: S310 - loopback only
            assert json.loads(r.read()) == {"deleted": 1}
        assert reg.versions("frank") == [] and not reg.path_of(m).exists()
        assert not list((data / "kv").rglob(f"{plan['block']['item_id']}*"))
        after = _post(f"{base}/v1/chat/completions", body)
        assert {u["id"]: u["tier"] for u in after["memory"]["used"]}.get(dog) is None
        assert "lora" not in {u["tier"] for u in after["memory"]["used"]}

"""`kvmem serve --backend vllm` as users start it (a subprocess on loopback, the CLI's own backend construction),
driven by the official openai client and the memory routes: the block is served from KV, and after DELETE
returns no request is answered from a block that held the deleted memory (vLLM keeps the old block resident
in its prefix cache; only the salt of a new block item keeps it out of reach)."""

from __future__ import annotations

import json
import urllib.request

import pytest

pytest.importorskip("vllm")

from openai import OpenAI  # noqa: E402

from benchmarks.load.http_client import _get, spawned_server, wait_for_block  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

TEXTS = [
    "I live in Lisbon with my sister and we share a small flat near the river.",
    "My dog is a golden retriever called Miso who loves the beach at Cascais.",
]
QUESTION = [{"role": "user", "content": "What is my dog called?"}]


def _call(url: str, method: str, body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:  # noqa: S310 - loopback only
        return json.loads(r.read())


def _ask(client: OpenAI, user: str, stream: bool):
    kw = dict(
        model=client.models.list().data[0].id, user=user, messages=QUESTION, temperature=0, max_tokens=8
    )
    if not stream:
        out = client.chat.completions.create(**kw)
        used = {(m["id"], m["tier"]) for m in out.model_extra["memory"]["used"]}
        return out.choices[0].message.content, out.usage.prompt_tokens_details.cached_tokens, used
    text, cached, used = [], None, set()
    for chunk in client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            cached = chunk.usage.prompt_tokens_details.cached_tokens
        memory = (chunk.model_extra or {}).get("memory")
        if memory:
            used = {(m["id"], m["tier"]) for m in memory["used"]}
    return "".join(text), cached, used


def test_kvmem_serve_backend_vllm_serves_the_block_and_delete_cuts_it_off(tmp_path, default_model_dir):
    with spawned_server(
        backend="vllm",
        model=str(default_model_dir),
        block_budget=2048,
        top_k=4,
        data_dir=str(tmp_path / "data"),
    ) as base:
        assert _get(f"{base}/health")["backend"] == "vllm"
        ids = [
            _call(f"{base}/v1/memories", "POST", {"user_id": "frank", "text": t})["memories"][0]["id"]
            for t in TEXTS
        ]
        plan = wait_for_block(base, "frank", len(TEXTS))
        block_tokens = plan["block"]["tokens"]
        client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=600)
        plain = _ask(client, "frank", stream=False)
        streamed = _ask(client, "frank", stream=True)
        assert plain[1] == streamed[1] == block_tokens > 0
        assert plain[2] == streamed[2] == {(i, "kv") for i in ids}
        assert plain[0] == streamed[0] and plain[0]

        assert _call(f"{base}/v1/memories/{ids[1]}?user_id=frank", "DELETE") == {"deleted": 1}
        # at once, before any rebuild could have happened: nothing of the old block (its whole KV blocks are
        # still in vLLM's prefix cache) may answer, so at most a block without the deleted memory is cached
        _, cached_after, used_after = _ask(client, "frank", stream=False)
        assert ids[1] not in {i for i, _ in used_after}
        assert cached_after < block_tokens
        new = wait_for_block(base, "frank", 1)
        assert new["block"]["memory_ids"] == [ids[0]] and new["block"]["tokens"] < block_tokens
        _, cached_new, used_new = _ask(client, "frank", stream=True)
        assert (cached_new, used_new) == (new["block"]["tokens"], {(ids[0], "kv")})

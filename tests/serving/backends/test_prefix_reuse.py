"""Automatic prefix reuse through the transformers backend (issue 44 item 5): a chat's second turn, sent with no
X-Session-Id, starts from the first turn's cached pages (cached_tokens: exactly its history's full pages) and
its greedy tokens are a cold prefill's; another user with the same conversation reuses nothing of it; a delete
of the user's memories takes their cached pages out of the pool before it returns."""

from __future__ import annotations

import asyncio

from kvmem.kv.inject import common_prefix_tokens
from serving.backends.base import GenerationRequest, SamplingParams
from tests.serving.backends.test_transformers_backend import tokens_of

FIRST = [
    {"role": "user", "content": "Tell me about the sea, the boats and the harbour at dawn, in a few words."}
]


def chat(backend, user: str, messages: list[dict]) -> GenerationRequest:
    prompt = backend.layout_prompt([], [], messages)
    return GenerationRequest(
        f"r-{user}-{len(messages)}", user, prompt, None, SamplingParams(max_new_tokens=8, temperature=0.0)
    )


def test_a_chats_second_turn_without_a_header_reuses_the_first_turns_pages(tiny_backend):
    backend, pt = tiny_backend, tiny_backend.pool.page_tokens
    first = chat(backend, "prefix-ann", FIRST)
    ids1, res1 = asyncio.run(tokens_of(backend, first))
    assert res1.cached_tokens == 0  # the system prompt's head only: no memory
    fed = [*first.prompt.ids, *ids1][: len(first.prompt.ids) + len(ids1) - 1]  # every token fed
    second_messages = [
        *FIRST,
        {"role": "assistant", "content": backend.handle.tokenizer.decode(ids1, skip_special_tokens=True)},
        {"role": "user", "content": "And the fish?"},
    ]
    second = chat(backend, "prefix-ann", second_messages)
    ids2, res2 = asyncio.run(tokens_of(backend, second))
    common = common_prefix_tokens(fed, second.prompt.ids)
    assert common >= 2 * pt  # the history is a prefix of the next prompt, past the head
    assert res2.cached_tokens == common // pt * pt  # exactly its history's full pages
    # a cold prefill of the same prompt (another user: nothing of Ann's is theirs) answers the same
    cold_ids, cold = asyncio.run(tokens_of(backend, chat(backend, "prefix-ben", second_messages)))
    assert cold.cached_tokens == 0 and cold_ids == ids2
    ann, ben = backend.pool.prefix.pages("prefix-ann"), backend.pool.prefix.pages("prefix-ben")
    assert ann and ben and set(ann).isdisjoint(ben)
    # a delete reaches the cached pages before it returns; another user's stay
    backend.forget("prefix-ann", None)
    assert backend.pool.prefix.pages("prefix-ann") == [] and backend.pool.prefix.pages("prefix-ben") == ben
    again_ids, again = asyncio.run(tokens_of(backend, chat(backend, "prefix-ann", second_messages)))
    assert again.cached_tokens == 0 and again_ids == ids2

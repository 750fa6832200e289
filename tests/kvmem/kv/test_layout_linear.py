"""Laying out a conversation is linear in its length and its ids are those of the per-prefix algorithm (kept
here verbatim as the reference), for SmolLM2's ChatML template, a Qwen3-like one that renders an assistant
message after the last user message differently, and templates the message-local path must hand back to it."""

from __future__ import annotations

import copy
import random

import pytest

from kvmem.kv import PromptLayout

# Qwen3's template without tools: an assistant message after the last user message carries its <think> block
QWEN3_LIKE = r"""
{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if '</think>' in content %}
            {%- set reasoning_content =
                content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}
            {{- '<|im_start|>assistant\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n'
                + content.lstrip('\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""
# plain text, messages apart by a blank line: the cuts fall inside text, so where they are changes the ids
PLAIN = (
    "{% for m in messages %}{% if not loop.first %}{{ '\n\n' }}{% endif %}{{ m.role + ': ' + m.content }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '\n\nassistant:' }}{% endif %}"
)
# PLAIN with each message's index: not message-local, so laid out by rendering every prefix
NUMBERED = (
    "{% for m in messages %}{% if not loop.first %}{{ '\n\n' }}{% endif %}"
    "{{ loop.index|string + ' ' + m.role + ': ' + m.content }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '\n\nassistant:' }}{% endif %}"
)
# refuses a conversation whose first message after the system is not a user's (as Llama 2 / Mistral do)
USER_FIRST = (
    "{% if messages|length > 1 and messages[1].role != 'user' %}"
    "{{ raise_exception('user first') }}{% endif %}"
    "{% for m in messages %}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
WORDS = [
    "Lisbon",
    "tea",
    "sister",
    "peanuts",
    "the",
    "a",
    "I",
    "you",
    "\n",
    "  ",
    "é",
    "日本",
    "?",
    "!",
    "42",
    "<b>",
]


class ReferenceLayout(PromptLayout):
    """PromptLayout with `_message_segments` as it was before it went linear (renders every prefix)."""

    def _message_segments(self, system, conversation, rendered, done):
        ids: list[int] = []
        for k in range(1, len(conversation) + 1):
            part = self._render([system, *conversation[:k]], False)
            if not (part.startswith(done) and rendered.startswith(part)):
                break
            ids.extend(self._encode(part[len(done) :]))
            done = part
        ids.extend(self._encode(rendered[len(done) :]))
        return ids


def with_template(tokenizer, template: str):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = template
    return tok


def text(rng: random.Random, max_words: int = 12) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, max_words))).strip(" ") or "ok"


def conversation(rng: random.Random, num_messages: int, *, user_first: bool = False) -> list[dict]:
    """Mostly alternating user/assistant, sometimes two of a role in a row, system messages anywhere (the
    layout moves them into its own), assistant replies sometimes carrying a <think> block; a user's last."""
    messages: list[dict] = []
    role = "user"
    for k in range(num_messages):
        if k == num_messages - 1 or (k == 0 and user_first):
            role = "user"
        elif rng.random() < 0.05:
            role = "system"
        elif rng.random() < 0.85:
            role = "assistant" if role == "user" else "user"
        content = text(rng)
        if role == "assistant" and rng.random() < 0.2:
            content = f"<think>\n{text(rng)}\n</think>\n\n{content}"
        messages.append({"role": role, "content": content})
    return messages


SIZES = [1, 2, 3, 4, 5, 7, 12, 25, 60, 140, 300]


def assert_same_as_reference(tok, *, seed: int, user_first: bool = False, sizes=SIZES) -> PromptLayout:
    """Randomized conversations of 1..300 messages with block and retrieved memories: the layout's prompt has
    the reference's ids, laid out cold (a fresh layout) and turn after turn on one layout (its cache warm)."""
    rng = random.Random(seed)
    layout, reference = PromptLayout(tok, system_prompt="SYS"), ReferenceLayout(tok, system_prompt="SYS")
    for n in sizes:
        messages = conversation(rng, n, user_first=user_first)
        blocks = [text(rng, 6) for _ in range(rng.randint(0, 4))]
        retrieved = [text(rng, 6) for _ in range(rng.randint(0, 3))]
        expected = reference.prompt(blocks, retrieved, messages)
        assert PromptLayout(tok, system_prompt="SYS").prompt(blocks, retrieved, messages) == expected, n
        # the last turns of the conversation, on the layout every size shares
        for cut in sorted({max(1, n - 4), max(1, n - 2), n}):
            turn = messages[:cut]
            mems = retrieved if any(m["role"] == "user" for m in turn) else []
            got = layout.prompt(blocks, mems, turn)
            assert got == reference.prompt(blocks, mems, turn), (n, cut)
    return layout


def test_chatml_layout_is_the_per_prefix_layout(tokenizer):
    layout = assert_same_as_reference(tokenizer, seed=0)
    assert not layout._by_prefix


def test_qwen3_like_layout_is_the_per_prefix_layout(tokenizer):
    """The template renders an earlier assistant message differently once a user message follows: the
    segments stop there as before, the rest is one segment."""
    tok = with_template(tokenizer, QWEN3_LIKE)
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>\nhm\n</think>\n\nHello"},
        {"role": "user", "content": "Bye"},
    ]
    last = tok.apply_chat_template(messages[:2], tokenize=False)
    assert "<think>" in last and "<think>" not in tok.apply_chat_template(messages, tokenize=False)
    layout = assert_same_as_reference(tok, seed=1)
    assert not layout._by_prefix


class OneSegment(PromptLayout):
    def _message_segments(self, system, conversation, rendered, done):
        return self._encode(rendered[len(done) :])


def test_plain_text_layout_is_the_per_prefix_layout_where_cuts_change_ids(tokenizer):
    """Under ChatML every cut falls before a special token, so any cuts give the same ids; under a plain-text
    template they do not (one segment for the whole history differs), so here the identity checks the cuts."""
    tok = with_template(tokenizer, PLAIN)
    rng = random.Random(4)
    conversations = [conversation(rng, n) for n in (3, 7, 12, 25)]
    assert any(
        OneSegment(tok).prompt(["x"], [], m) != ReferenceLayout(tok).prompt(["x"], [], m)
        for m in conversations
    )
    layout = assert_same_as_reference(tok, seed=5)
    assert not layout._by_prefix


@pytest.mark.parametrize("template", [NUMBERED, USER_FIRST], ids=["numbered", "user_first"])
def test_templates_that_are_not_message_local_are_laid_out_by_prefix(tokenizer, template):
    """A message's text that carries its index, or a template that refuses a conversation of one assistant
    message: the checks catch it, and the layout renders every prefix from then on (same ids)."""
    layout = assert_same_as_reference(
        with_template(tokenizer, template), seed=2, user_first=True, sizes=[1, 2, 5, 12, 40]
    )
    assert layout._by_prefix


def count_renders(layout: PromptLayout, monkeypatch) -> list[int]:
    calls: list[int] = []  # number of messages of each render
    render = layout._render

    def counted(messages, generation_prompt):
        calls.append(len(messages))
        return render(messages, generation_prompt)

    monkeypatch.setattr(layout, "_render", counted)
    return calls


@pytest.mark.parametrize("num_messages", [21, 201])
def test_a_turn_renders_its_new_messages_and_the_whole_conversation_twice(
    tokenizer, monkeypatch, num_messages
):
    """Cold: one small render per message (itself after a stand-in of its predecessor's role), one per
    predecessor role (the stand-in alone), and two of the whole conversation (the prompt, and the check of the
    last cut). The next turn (the reply and a new user message) renders only its new messages' windows: the
    same count at 21 and at 201 messages."""
    rng = random.Random(3)
    layout = PromptLayout(tokenizer)
    assert layout.system_open  # rendered once per layout
    calls = count_renders(layout, monkeypatch)
    roles = ["user", "assistant"]
    messages = [{"role": roles[k % 2], "content": f"{k}: {text(rng)}"} for k in range(num_messages)]
    layout.prompt([], ["I like tea."], messages)
    assert len(calls) == num_messages + 2 + 2
    assert sorted(calls)[-2:] == [num_messages + 1] * 2  # the system message and the whole conversation
    calls.clear()
    messages += [{"role": "assistant", "content": "Noted."}, {"role": "user", "content": "And then?"}]
    turn = layout.prompt([], ["I like coffee."], messages)
    # the last user message without its retrieved memories, the reply, the new user message with them
    assert len(calls) == 3 + 2
    assert turn == ReferenceLayout(tokenizer).prompt([], ["I like coffee."], messages)


def test_the_segment_cache_is_bounded_in_tokens_and_changes_no_ids(tokenizer):
    """Least recently used segments go once the cache is over its tokens; a small cache, or none, lays out the
    same ids (it only renders more)."""
    rng = random.Random(6)
    messages = conversation(rng, 40, user_first=True)
    expected = ReferenceLayout(tokenizer).prompt(["x"], ["y"], messages)
    for budget in (0, 50, 1 << 20):
        layout = PromptLayout(tokenizer, max_cached_tokens=budget)
        assert layout.prompt(["x"], ["y"], messages) == expected
        assert layout.prompt(["x"], ["y"], messages) == expected  # again, from what the cache kept
        assert layout._cached_tokens <= budget
        assert (len(layout._segments) > 0) == (budget > 0)
    with pytest.raises(ValueError, match="max_cached_tokens >= 0, got -1"):
        PromptLayout(tokenizer, max_cached_tokens=-1)


def test_threads_sharing_a_layout_get_the_reference_ids(tokenizer):
    """The segment cache is shared and locked: threads laying out overlapping conversations (the same history,
    different lengths) at once each get the reference's ids."""
    from concurrent.futures import ThreadPoolExecutor

    rng = random.Random(7)
    messages = conversation(rng, 30, user_first=True)
    users = [k + 1 for k, m in enumerate(messages) if m["role"] == "user"]
    turns = [messages[:n] for n in users] * 3
    reference = ReferenceLayout(tokenizer)
    expected = [reference.prompt(["x"], ["y"], turn) for turn in turns]
    layout = PromptLayout(tokenizer, max_cached_tokens=300)  # small: entries dropped while others read
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda turn: layout.prompt(["x"], ["y"], turn), turns))
    assert got == expected
    assert layout._cached_tokens <= 300

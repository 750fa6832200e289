"""The prompt layout: the block is an exact token prefix, grows append-only, and the rest of the prompt is
the chat template's own rendering."""

from __future__ import annotations

import pytest

from kvmem.kv import LayoutError, PromptLayout
from kvmem.kv.layout import MEMORY_HEADER, RETRIEVED_HEADER, memory_line

MEMS = ["I live in Lisbon.", "My sister is a teacher.", "I am allergic to peanuts."]


def test_block_is_prefix_of_every_prompt_and_grows_append_only(tokenizer):
    layout = PromptLayout(tokenizer)
    block = layout.block_ids(MEMS)
    for text_mems, messages in [
        ([], [{"role": "user", "content": "hi"}]),
        (
            ["I like tea."],
            [
                {"role": "user", "content": "a"},
                {"role": "assistant", "content": "b"},
                {"role": "user", "content": "c"},
            ],
        ),
        ([], [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where do I live?"}]),
    ]:
        p = layout.prompt(MEMS, text_mems, messages)
        assert p.block_len == len(block) and p.ids[: p.block_len] == tuple(block)
    for k in range(len(MEMS)):
        assert layout.block_ids(MEMS[: k + 1])[: len(layout.block_ids(MEMS[:k]))] == layout.block_ids(
            MEMS[:k]
        )


def test_the_block_tells_the_memories_about_the_user_under_a_context_header(tokenizer):
    """Layout 3: the block's text, exactly, is the memories in the third person under "Known facts about the
    user"; the retrieved memories likewise open the last user message. Both paths encode this text."""
    layout = PromptLayout(tokenizer, system_prompt="SYS")
    head = layout.system_open + "SYS\n\nKnown facts about the user (from earlier conversations):\n"
    block_text = head + "- The user lives in Lisbon.\n- The user's sister is a teacher.\n"
    assert tokenizer.decode(layout.block_ids(MEMS[:2])) == block_text
    p = layout.prompt(MEMS[:2], MEMS[2:], [{"role": "user", "content": "Where do I live?"}])
    assert tokenizer.decode(p.ids[: p.block_len]) == block_text
    last = (
        "Known facts about the user that may help with this message:\n- The user is allergic to peanuts.\n\n"
    )
    assert last + "Where do I live?" in tokenizer.decode(p.ids[p.block_len :])


def test_prompt_with_the_blocks_ids_given_is_the_same_prompt(tokenizer):
    """A plan hands over the ids the block was built from; the prompt must not change by a single id."""
    layout = PromptLayout(tokenizer)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where do I live?"}]
    given = layout.prompt(MEMS, ["I like tea."], messages, block_ids=tuple(layout.block_ids(MEMS)))
    assert given == layout.prompt(MEMS, ["I like tea."], messages)


def test_prompt_decodes_to_the_chat_template_rendering(tokenizer):
    """Block memories and the client's system message in the system message; this turn's retrieved memories
    at the start of the last user message, after the history."""
    layout = PromptLayout(tokenizer, system_prompt="SYS")
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello."},
        {"role": "assistant", "content": "Hi!"},
        {"role": "user", "content": "Where do I live?"},
    ]
    p = layout.prompt(MEMS[:2], MEMS[2:], messages)
    system = "SYS" + MEMORY_HEADER + "".join(memory_line(m) for m in MEMS[:2]) + "\nBe brief."
    last = RETRIEVED_HEADER + memory_line(MEMS[2]) + "\nWhere do I live?"
    expected = tokenizer.apply_chat_template(
        [{"role": "system", "content": system}, *messages[1:3], {"role": "user", "content": last}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert tokenizer.decode(p.ids) == expected


def test_block_system_and_history_are_an_exact_prefix_of_the_next_turn(tokenizer):
    """What a live session's cache holds after a turn, up to the turn's last user message, is an exact id
    prefix of the next turn's prompt, whatever memories each turn retrieved."""
    layout = PromptLayout(tokenizer)
    turn1 = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where do I live?"}]
    turn2 = [*turn1, {"role": "assistant", "content": "In Lisbon."}, {"role": "user", "content": "And?"}]
    p1 = layout.prompt(MEMS[:2], ["I like tea."], turn1)
    p2 = layout.prompt(MEMS[:2], ["I like coffee.", "I swim."], turn2)
    history = layout.prompt(MEMS[:2], [], turn1[:1])  # block + client system, then the generation prompt
    gen_prompt = len(tokenizer("<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"])
    stable = len(history.ids) - gen_prompt
    assert p1.ids[:stable] == p2.ids[:stable] == history.ids[:stable]
    # turn 2's own prompt, without retrieved memories, up to its last user message, is a prefix of both
    plain = layout.prompt(MEMS[:2], [], turn2[:3])
    n = len(plain.ids) - len(tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"])
    assert p2.ids[:n] == plain.ids[:n]
    assert tokenizer.decode(p2.ids[n:]).startswith("<|im_start|>user\n" + RETRIEVED_HEADER)


def test_no_block_memories_means_block_len_zero(tokenizer):
    p = PromptLayout(tokenizer).prompt([], ["I like tea."], [{"role": "user", "content": "hi"}])
    assert p.block_len == 0


def test_template_without_system_role_is_a_clear_error(tokenizer):
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = (
        "{% for m in messages %}{% if m.role != 'system' %}{{ m.content }}{% endif %}{% endfor %}"
    )
    with pytest.raises(LayoutError, match="system message"):
        PromptLayout(tok).block_ids(MEMS)


def test_items_built_under_the_previous_layout_are_refused_and_rebuilt(tmp_path, tiny_handle, tokenizer):
    """The layout version is in every item's fingerprint (binding): an item built under layout 1 is never
    served by a layout-3 store; building the same block again makes a new item that is."""
    from kvmem.errors import KVItemError
    from kvmem.kv import LAYOUT_VERSION, KVStoreConfig, TieredKVStore
    from kvmem.kv.blocks import BlockBuilder
    from kvmem.models import handle_for

    assert LAYOUT_VERSION == "3" and tiny_handle.fingerprint.layout_version == LAYOUT_VERSION
    digest = tiny_handle.fingerprint.weights_sha
    old = handle_for(tiny_handle.model, tokenizer, model_id="tiny", layout_version="1", weights_digest=digest)
    assert old.fingerprint.mismatches(tiny_handle.fingerprint) == ["layout_version"]
    layout = PromptLayout(tokenizer)

    def store(handle):
        return TieredKVStore(KVStoreConfig(directory=str(tmp_path)), handle.fingerprint)

    stale = BlockBuilder(old, layout, store(old)).build("alice", MEMS, ["m1", "m2", "m3"]).item_id
    current = store(tiny_handle)
    with pytest.raises(KVItemError, match="layout_version"):
        current.get(stale)
    assert not current.contains(stale) and not list(tmp_path.glob(f"{stale}*"))  # dropped, files deleted
    fresh = BlockBuilder(tiny_handle, layout, current).build("alice", MEMS, ["m1", "m2", "m3"]).item_id
    assert fresh != stale
    assert current.get(fresh).meta.fingerprint.layout_version == "3"
    assert current.forget("alice", ["m2"]) == [fresh]

"""The prompt layout, as token ids: `[block][client system][history][retrieved memories + query]`.

The block is the system-message opening, our system prompt, a memory header and the hot memories, one
memory per segment. The client's system messages follow inside the same system message, then the
conversation, one segment per message, and this turn's retrieved memories go inside the last user message,
before its text. Segments are tokenized separately and concatenated, so a block's ids are an exact prefix of
every prompt that uses it, a block for memories [m1..mk] is a prefix of the block for [m1..mk, mk+1]
(append-only growth keeps stored prefixes valid), and [block][client system][history] is an exact prefix of
the next turn's prompt (a live session's KV cache covers it: kvmem/kv/session.py). The chat template's own
text is used for the system opening and for everything after the system message. Knows nothing of stores or
tiers. Version 2: version 1 put the retrieved memories before the client system and the history.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

LAYOUT_VERSION = "2"
DEFAULT_SYSTEM_PROMPT = (
    "You are a helpful assistant with long-term memory. Use what you remember about the user when it helps."
)
MEMORY_HEADER = "\n\nWhat you remember about the user:\n"
KNOWLEDGE_HEADER = "\n\nWhat you know (shared by every user):\n"
# opens this turn's retrieved memories inside the last user message; the user's own text follows a blank line
RETRIEVED_HEADER = "Memories that may help with this message:\n"
_SENTINEL = "\u2063KVMEM\u2063"


class LayoutError(ValueError):
    """The tokenizer's chat template cannot express this layout (e.g. it rewrites system content)."""


@dataclass(frozen=True)
class LaidOutPrompt:
    """Token ids of a whole prompt; `ids[:block_len]` are exactly the block's ids (0: no block)."""

    ids: tuple[int, ...]
    block_len: int


def memory_line(text: str) -> str:
    return "- " + " ".join(text.split()) + "\n"


class PromptLayout:
    """Lays out prompts for one tokenizer + system prompt. Thread-safe after construction (read-only)."""

    def __init__(
        self,
        tokenizer,
        system_prompt: str = DEFAULT_SYSTEM_PROMPT,
        version: str = LAYOUT_VERSION,
        knowledge: Sequence[str] = (),
    ):
        """`knowledge`: the deployment's shared texts (kvmem.kv.knowledge), laid out after the system prompt,
        before the memory header, as one segment: `knowledge_ids` is a prefix of every block."""
        if not getattr(tokenizer, "chat_template", None):
            raise LayoutError("the tokenizer has no chat template")
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        self.version = version
        self.knowledge_text = (
            KNOWLEDGE_HEADER + "".join(memory_line(t) for t in knowledge) if knowledge else ""
        )

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )

    @cached_property
    def system_open(self) -> str:
        """The template's text before the system message's content (e.g. '<|im_start|>system\\n')."""
        rendered = self._render(
            [{"role": "system", "content": _SENTINEL}, {"role": "user", "content": "x"}], True
        )
        if _SENTINEL not in rendered:
            raise LayoutError("the chat template does not render the system message's content verbatim")
        return rendered[: rendered.index(_SENTINEL)]

    @cached_property
    def knowledge_ids(self) -> tuple[int, ...]:
        """The shared prefix of every block (system opening, prompt, knowledge); () without knowledge."""
        if not self.knowledge_text:
            return ()
        return tuple(self._encode(self.system_open + self.system_prompt + self.knowledge_text))

    @cached_property
    def _head_ids(self) -> tuple[int, ...]:
        if self.knowledge_text:
            return self.knowledge_ids + tuple(self._encode(MEMORY_HEADER))
        return tuple(self._encode(self.system_open + self.system_prompt + MEMORY_HEADER))

    @property
    def head_ids(self) -> tuple[int, ...]:
        """The ids every block starts with (system opening, prompt, knowledge, memory header)."""
        return self._head_ids

    def block_ids(self, block_texts: Sequence[str]) -> list[int]:
        """Ids of the block for these memories, in order. With no memories: the head alone."""
        ids = list(self._head_ids)
        for text in block_texts:
            ids.extend(self._encode(memory_line(text)))
        return ids

    def prompt(
        self,
        block_texts: Sequence[str],
        text_texts: Sequence[str],
        messages: Sequence[dict],
        *,
        block_ids: Sequence[int] | None = None,
    ) -> LaidOutPrompt:
        """Lay out a whole prompt ending with the generation prompt.

        `messages` are chat messages ({"role", "content"}); system messages from the client are appended to
        our system message after the block's memories (a conversation's system message does not change from
        turn to turn, so it stays in the stable prefix), the rest form the conversation, and `text_texts` go
        at the start of the last user message. `block_ids`, when the caller has them (`block_ids(block_texts)`
        from when the block was built), spare tokenizing the block again.
        """
        client_system = "\n".join(str(m["content"]) for m in messages if m["role"] == "system")
        conversation = [
            {"role": m["role"], "content": str(m["content"])} for m in messages if m["role"] != "system"
        ]
        if text_texts:
            users = [i for i, m in enumerate(conversation) if m["role"] == "user"]
            if not users:
                raise LayoutError("retrieved memories go in a user message, and there is none")
            last = conversation[users[-1]]
            retrieved = RETRIEVED_HEADER + "".join(memory_line(t) for t in text_texts) + "\n"
            conversation[users[-1]] = {"role": "user", "content": retrieved + last["content"]}
        block = self.block_ids(block_texts) if block_ids is None else block_ids
        ids = list(block)
        system_content = self.system_prompt + self.knowledge_text + MEMORY_HEADER
        system_content += "".join(memory_line(t) for t in block_texts)
        if client_system:
            system_content += "\n" + client_system
            ids.extend(self._encode("\n" + client_system))
        system = {"role": "system", "content": system_content}
        rendered = self._render([system, *conversation], True)
        done = self.system_open + system_content
        if not rendered.startswith(done):
            raise LayoutError(
                "the chat template rewrites the system message content; this layout needs it verbatim"
            )
        ids.extend(self._message_segments(system, conversation, rendered, done))
        return LaidOutPrompt(ids=tuple(ids), block_len=len(block) if block_texts else 0)

    def _message_segments(
        self, system: dict, conversation: list[dict], rendered: str, done: str
    ) -> list[int]:
        """Ids of `rendered` after `done`: one segment per message while the template renders the conversation
        append-only (each message's text is the same whatever follows it), then the rest as one segment (a
        template that renders an earlier message differently once more follow, as Qwen3's does for an
        assistant message after the last user message: still exact, the next turn reuses less)."""
        ids: list[int] = []
        for k in range(1, len(conversation) + 1):
            part = self._render([system, *conversation[:k]], False)
            if not (part.startswith(done) and rendered.startswith(part)):
                break
            ids.extend(self._encode(part[len(done) :]))
            done = part
        ids.extend(self._encode(rendered[len(done) :]))
        return ids

"""The prompt layout, as token ids: `[block][client system][history][retrieved memories + query]`.

The block is the system-message opening, our system prompt, a memory header and the hot memories, one
memory per segment. The client's system messages follow inside the same system message, then the
conversation, one segment per message, and this turn's retrieved memories go inside the last user message,
before its text. Segments are tokenized separately and concatenated, so a block's ids are an exact prefix of
every prompt that uses it, a block for memories [m1..mk] is a prefix of the block for [m1..mk, mk+1]
(append-only growth keeps stored prefixes valid), and [block][client system][history] is an exact prefix of
the next turn's prompt (a live session's KV cache covers it: serving/engine/sessions.py). The chat template's own
text is used for the system opening and for everything after the system message. Each message's segment is
rendered once, after a stand-in for its predecessor, and cached: a prompt costs one small render per message
not seen before plus the whole conversation's render and one or two of its prefixes (checks), so it is linear
in the conversation's length and a session's next turn renders only its new messages. Knows nothing of stores
or tiers. Version 2: version 1 put the retrieved memories before the client system and the history. Version 3:
memories in the third person under a context header (`memory_line`).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from jinja2 import TemplateError

from kvmem.kv.user_facts import third_person

log = logging.getLogger(__name__)

LAYOUT_VERSION = "3"
# tried and not kept (e512a6c): adding "; when the user asks about themselves, answer from the facts below" cut
# the demo model's answers in the user's voice (9 of 66 against 16 over six orders of two blocks,
# benchmarks/memory/block_wording.py) but answered no more questions right (the held-out's 31 of 36 against
# 33), and the real-model LoRA test's damage gate fell to 0.890 greedy agreement under it (gate 0.90)
DEFAULT_SYSTEM_PROMPT = (
    "You are a helpful assistant with long-term memory. Use what you remember about the user when it helps."
)
# memories are told about the user in the third person under a header that marks them as context (version 3;
# version 2 listed them in the user's own words under "What you remember about the user:", and small models
# answered in the user's voice, echoing them)
MEMORY_HEADER = "\n\nKnown facts about the user (from earlier conversations):\n"
KNOWLEDGE_HEADER = "\n\nWhat you know (shared by every user):\n"
# opens this turn's retrieved memories inside the last user message; the user's own text follows a blank line
RETRIEVED_HEADER = "Known facts about the user that may help with this message:\n"
_SENTINEL = "\u2063KVMEM\u2063"
# the system message of the small conversations a message's own segment is rendered in, and the content of
# the stand-in for its predecessor there
_WINDOW_SYSTEM = {"role": "system", "content": _SENTINEL}
_STAND_IN = _SENTINEL
_MISSING = object()  # not in the segment cache


class LayoutError(ValueError):
    """The tokenizer's chat template cannot express this layout (e.g. it rewrites system content)."""


@dataclass(frozen=True)
class LaidOutPrompt:
    """Token ids of a whole prompt; `ids[:block_len]` are exactly the block's ids (0: no block)."""

    ids: tuple[int, ...]
    block_len: int


@dataclass(frozen=True)
class _Segment:
    """A message's text as the template renders it after a message of its predecessor's role, and its ids."""

    text: str
    ids: tuple[int, ...]


def _cost(value: _Segment | str | None) -> int:
    """What a segment cache entry counts against `max_cached_tokens`."""
    return 1 + (len(value.ids) if isinstance(value, _Segment) else 0)


def memory_line(text: str) -> str:
    """A memory's line in the block or the retrieved list: the fact told about the user (`third_person`)."""
    return "- " + third_person(text) + "\n"


def knowledge_line(text: str) -> str:
    """A shared knowledge text's line, as written."""
    return "- " + " ".join(text.split()) + "\n"


class PromptLayout:
    """Lays out prompts for one tokenizer + system prompt. Thread-safe: the message segment cache is the only
    state that changes after construction, under a lock."""

    def __init__(
        self,
        tokenizer,
        system_prompt: str = DEFAULT_SYSTEM_PROMPT,
        version: str = LAYOUT_VERSION,
        knowledge: Sequence[str] = (),
        max_cached_tokens: int = 1 << 20,
    ):
        """`knowledge`: the deployment's shared texts (kvmem.kv.knowledge), laid out after the system prompt,
        before the memory header, as one segment: `knowledge_ids` is a prefix of every block.
        `max_cached_tokens`: the messages' segments kept, in tokens (an entry counts its ids and one more;
        least recently used dropped first), 0 for none; ~50 bytes a token (ids, text, message content)."""
        if not getattr(tokenizer, "chat_template", None):
            raise LayoutError("the tokenizer has no chat template")
        if max_cached_tokens < 0:
            raise ValueError(f"PromptLayout needs max_cached_tokens >= 0, got {max_cached_tokens}")
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        self.version = version
        self.knowledge_text = (
            KNOWLEDGE_HEADER + "".join(knowledge_line(t) for t in knowledge) if knowledge else ""
        )
        self.max_cached_tokens = max_cached_tokens
        # (previous role, role, content) -> the segment, or None where the template renders a message of the
        # previous role differently once this one follows (the first message's previous role is None); and
        # (previous role,) -> the small conversation of the stand-in alone
        self._segments: OrderedDict[tuple, _Segment | str | None] = OrderedDict()
        self._segments_lock = threading.Lock()
        self._cached_tokens = 0
        self._by_prefix = False  # set for good once a prompt showed the template is not message-local

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
        assistant message after the last user message: still exact, the next turn reuses less).

        The ids are those of `_prefix_segments`, which renders every prefix of the conversation (quadratic in
        its length). Here each message's segment comes from rendering it after a stand-in for its predecessor
        (`_segment_text`, cached), checked against `rendered`, and the cut where the segments stop is
        checked against one or two renders of the real prefixes. A template those checks catch (one whose text
        for a message depends on more than the message and its predecessor's role, or that refuses the small
        conversations) is laid out by `_prefix_segments` from then on."""
        if not self._by_prefix:
            ids = self._local_segments(system, conversation, rendered, done)
            if ids is not None:
                return ids
            self._by_prefix = True
            log.warning(
                "the chat template is not message-local; prompts are laid out by rendering every prefix "
                "(quadratic in conversation length)"
            )
        return self._prefix_segments(system, conversation, rendered, done)

    def _local_segments(
        self, system: dict, conversation: list[dict], rendered: str, done: str
    ) -> list[int] | None:
        """`_message_segments` from the messages' own segments; None where a check shows it could differ."""
        cut = len(done)
        kept: list[tuple] = []  # the keys of the segments kept, in order
        known: dict[tuple, _Segment | str | None] = {}  # cached segments; texts rendered now, encoded below
        try:
            for k, message in enumerate(conversation):
                key = (conversation[k - 1]["role"] if k else None, message["role"], message["content"])
                if key not in known:
                    known[key] = self._lookup(key)
                    if known[key] is _MISSING:
                        known[key] = self._segment_text(key[0], message)
                segment = known[key]
                text = segment.text if isinstance(segment, _Segment) else segment
                if text is None or not rendered.startswith(text, cut):
                    break
                kept.append(key)
                cut += len(text)
        except TemplateError:  # e.g. a template that wants the first message after the system to be a user's
            return None
        # what `_prefix_segments` checks at the last segment it keeps and at the first it stops at
        if kept and self._render([system, *conversation[: len(kept)]], False) != rendered[:cut]:
            return None
        if len(kept) < len(conversation):
            part = self._render([system, *conversation[: len(kept) + 1]], False)
            if part.startswith(rendered[:cut]) and rendered.startswith(part):
                return None
        fresh = [(key, v) for key, v in known.items() if not isinstance(v, _Segment)]
        encoded = iter(self._encode_many([text for _, text in fresh if text is not None]))
        for key, text in fresh:
            known[key] = None if text is None else _Segment(text, tuple(next(encoded)))
            self._keep(key, known[key])
        ids: list[int] = []
        for key in kept:
            ids.extend(known[key].ids)
        ids.extend(self._encode(rendered[cut:]))
        return ids

    def _encode_many(self, texts: list[str]) -> list[list[int]]:
        """`_encode` of each text, in one call to the tokenizer (the ids are those of one call each)."""
        nonempty = [t for t in texts if t]
        batch = iter(self.tokenizer(nonempty, add_special_tokens=False)["input_ids"] if nonempty else ())
        return [next(batch) if t else [] for t in texts]

    def _segment_text(self, previous_role: str | None, message: dict) -> str | None:
        """`message`'s text rendered right after a message of `previous_role` (None: right after the system
        message's content) in a conversation of just those two, with the stand-in content for the first; None
        if the stand-in renders differently once `message` follows."""
        if previous_role is None:
            before, window = self.system_open + _SENTINEL, [_WINDOW_SYSTEM]
        else:
            window = [_WINDOW_SYSTEM, {"role": previous_role, "content": _STAND_IN}]
            before = self._lookup((previous_role,))
            if before is _MISSING:
                before = self._render(window, False)
                self._keep((previous_role,), before)
        after = self._render([*window, message], False)
        return after[len(before) :] if after.startswith(before) else None

    def _lookup(self, key: tuple) -> _Segment | str | None | object:
        """The segment cache's value for `key` (now the most recently used), or `_MISSING`."""
        with self._segments_lock:
            if key not in self._segments:
                return _MISSING
            self._segments.move_to_end(key)
            return self._segments[key]

    def _keep(self, key: tuple, value: _Segment | str | None) -> None:
        """Cache `value` for `key`, dropping the least recently used entries past `max_cached_tokens`."""
        with self._segments_lock:
            if key in self._segments or _cost(value) > self.max_cached_tokens:
                return
            self._segments[key] = value
            self._cached_tokens += _cost(value)
            while self._cached_tokens > self.max_cached_tokens:
                self._cached_tokens -= _cost(self._segments.popitem(last=False)[1])

    def _prefix_segments(self, system: dict, conversation: list[dict], rendered: str, done: str) -> list[int]:
        """`_message_segments` by rendering every prefix of the conversation (quadratic in its length): for
        templates whose message text depends on more than the message and its predecessor's role."""
        ids: list[int] = []
        for k in range(1, len(conversation) + 1):
            part = self._render([system, *conversation[:k]], False)
            if not (part.startswith(done) and rendered.startswith(part)):
                break
            ids.extend(self._encode(part[len(done) :]))
            done = part
        ids.extend(self._encode(rendered[len(done) :]))
        return ids

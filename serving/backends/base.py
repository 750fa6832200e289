"""The backend interface: what serving asks of a model engine, and the named results it gets back.

Owns the request/result dataclasses and the exceptions the HTTP layer maps to status codes. Knows nothing of
HTTP, memories or plans: a backend sees token ids, an optional KV block item id and sampling parameters.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from serving.engine.errors import PoolFull as PoolFull  # the engine's, re-exported for the backends
from serving.engine.errors import PoolTooSmall as PoolTooSmall

if TYPE_CHECKING:
    from kvmem.kv.blocks import BuiltBlock


class BackendError(RuntimeError):
    """A backend failed for a reason that is not the caller's fault (mapped to HTTP 500)."""


class QueueFull(BackendError):
    """The backend's bounded request queue is full; the caller may retry later (HTTP 429)."""


class NotReady(BackendError):
    """The model is not loaded yet, or failed to load (HTTP 503)."""


class BuildCancelled(BackendError):
    """A block build was cancelled (`cancel_builds`: the server is shutting down); nothing of it was stored."""


class BlockNotFound(BackendError):
    """The request's block item is not stored (dropped since the request was prepared: a delete's cascade, an
    eviction). Raised by `stream` before its first item, nothing generated: the prompt holds the block's texts,
    which may have been deleted since, so serving prepares the request again rather than prefilling them."""

    def __init__(self, item_id: str) -> None:
        super().__init__(f"KV item {item_id} is not stored")
        self.item_id = item_id


class PromptTooLong(ValueError):
    """The laid-out prompt leaves no room for a single new token in the context window (HTTP 400)."""

    def __init__(self, num_prompt_tokens: int, max_context_tokens: int) -> None:
        super().__init__(
            f"the prompt has {num_prompt_tokens} tokens; the model's context length is {max_context_tokens} "
            "tokens and at least one must be left for the reply"
        )
        self.num_prompt_tokens = num_prompt_tokens
        self.max_context_tokens = max_context_tokens


# The optional OpenAI sampling features a backend may honour (Backend.sampling_features); serving refuses a
# request that asks a backend for one it does not list (400 unsupported_parameter), never ignores it.
SAMPLING_FEATURES = ("presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "response_format")


class InvalidResponseFormat(ValueError):
    """A response format the backend cannot compile (HTTP 400 invalid_response_format); says why."""


@dataclass(frozen=True)
class ResponseFormat:
    """OpenAI's `response_format` beyond text: "json_object" (any JSON object) or "json_schema" (`schema`,
    the schema as JSON text with sorted keys, named `name`)."""

    type: str
    schema: str | None = None
    name: str = ""

    def __post_init__(self) -> None:
        if self.type not in ("json_object", "json_schema"):
            raise ValueError(f"response format type must be json_object or json_schema, got {self.type!r}")
        if (self.type == "json_schema") != (self.schema is not None):
            raise ValueError("a json_schema response format has a schema, a json_object one none")


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. temperature 0 means greedy; seed makes sampling reproducible per request. Penalties and
    logit_bias follow OpenAI (kvmem/kv/decode.py Sampling); top_logprobs None: no log-probabilities, else the
    chosen token's and the top_logprobs most likely tokens' (0..20) come with each TokenDelta."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100])
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None  # None: text

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if any(t < 0 or not -100.0 <= b <= 100.0 for t, b in self.logit_bias):
            raise ValueError("logit_bias needs token ids >= 0 and biases in [-100, 100]")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20:
            raise ValueError(f"top_logprobs must be in [0, 20] or None, got {self.top_logprobs}")

    @property
    def features(self) -> frozenset[str]:
        """The SAMPLING_FEATURES this request asks for (a zero penalty or an empty bias asks for nothing)."""
        asked = {
            "presence_penalty": self.presence_penalty != 0.0,
            "frequency_penalty": self.frequency_penalty != 0.0,
            "logit_bias": bool(self.logit_bias),
            "logprobs": self.top_logprobs is not None,
            "response_format": self.response_format is not None,
        }
        return frozenset(name for name, on in asked.items() if on)


@dataclass(frozen=True)
class TopLogprob:
    """One of the most likely tokens at a step: its text, log-probability and UTF-8 bytes."""

    token: str
    logprob: float
    bytes: tuple[int, ...]


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's text, log-probability and bytes, and the most likely tokens at its step."""

    token: str
    logprob: float
    bytes: tuple[int, ...]
    top_logprobs: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True)
class LaidOutPrompt:
    """A prompt as token ids. ids[:block_len] are exactly the block's token ids (block_len 0: no block)."""

    ids: tuple[int, ...]
    block_len: int

    def __post_init__(self) -> None:
        assert 0 <= self.block_len <= len(self.ids), (self.block_len, len(self.ids))


@dataclass(frozen=True)
class GenerationRequest:
    """One generation. block_item_id names the KV item holding prompt.ids[:prompt.block_len], or None.
    session_id: the conversation (X-Session-Id) whose KV cache an engine may keep and start the next turn from
    (None: none kept); memory_ids: every memory whose text the prompt carries (block and retrieved), so a delete
    can drop a kept cache that carries it."""

    request_id: str
    user_id: str
    prompt: LaidOutPrompt
    block_item_id: str | None
    sampling: SamplingParams
    adapter_id: str | None = None
    session_id: str | None = None
    memory_ids: tuple[str, ...] = ()
    # low priority: memory formation on the server's own model (the engine's budget: serving/engine/batcher.py)
    background: bool = False


@dataclass(frozen=True)
class TokenDelta:
    """Newly produced text and the token ids behind it (text may be empty while a character is incomplete);
    with SamplingParams.top_logprobs set, one TokenLogprob per token id."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()
    # another item of the same stream was handed over with this one: the SSE writer writes their chunks in one
    # write (serving/chat/sse.py); not part of what the delta says
    more: bool = field(default=False, compare=False)


# Why a request's KV block could not be used, as a fixed category: it is a metrics label on an unauthenticated
# route, so it never carries an item id, a path or an exception's text (those go to the log line).
KV_FALLBACK_KINDS = (
    "not_found",  # no such item in any tier (never built, evicted and dropped, or removed): BlockNotFound
    "corrupt",  # its files are truncated or fail their checksum
    "fingerprint_mismatch",  # made by another model, tokenizer, dtype, template, layout or RoPE config
    "wrong_user",  # the item belongs to another user (refused: invariant 4)
    "prefix_mismatch",  # its tokens are not the prompt's block
    "recompute",  # a load from its tier costs more than its prefill here: prefilled as text (not unservable)
    "other",  # any other reason
)


@dataclass(frozen=True)
class GenerationResult:
    """The last item of a stream. finish_reason is "stop" (EOS or a stop string) or "length".
    kv_fallback_reason: None when the block (if any) was served from KV, else one of KV_FALLBACK_KINDS."""

    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_s: float
    kv_fallback_reason: str | None = None

    def __post_init__(self) -> None:
        if self.kv_fallback_reason is not None and self.kv_fallback_reason not in KV_FALLBACK_KINDS:
            raise ValueError(
                f"kv_fallback_reason must be one of {KV_FALLBACK_KINDS} or None, "
                f"got {self.kv_fallback_reason!r}"
            )


StreamItem = TokenDelta | GenerationResult


class Backend(ABC):
    """A model engine behind the OpenAI server.

    Lifecycle: the constructor is cheap (no weights); `load()` is called once, in a worker thread, at server
    start; `is_ready()` turns True when it returns; `aclose()` at shutdown. All methods except `stream` and
    `aclose` are blocking and thread-safe: serving calls them through `asyncio.to_thread`.
    """

    name: str
    model_id: str
    max_context_tokens: int
    # whether a request's `adapter_id` is applied (LoRA); the scheduler's plans name no adapter otherwise, so
    # an adapter's facts are never left out of a prompt that will not get them from the adapter
    serves_adapters: bool = False
    # the SAMPLING_FEATURES it applies; serving refuses a request asking for another (400, naming the field)
    sampling_features: frozenset[str] = frozenset()
    # the model's vocabulary size (logit_bias token ids must be below it); None: not known (not loaded)
    vocab_size: int | None = None
    # whether `build_block(..., adapter_id=...)` computes a block under a user's LoRA adapter; without it a
    # user served an adapter has no block (the rest of their memories go as text)
    builds_under_adapter: bool = False
    # whether blocks outlive the process where `find_block` finds them again (a restart, `kvmem build`): the
    # scheduler restores plans at start only over such a backend
    finds_stored_blocks: bool = False
    knowledge_generation: int = 0  # prompt layouts switched to since load (`reload_knowledge`)

    @abstractmethod
    def load(self) -> None:
        """Load weights and tokenizer. Blocking, idempotent. Raises BackendError if the model cannot load."""

    @abstractmethod
    def is_ready(self) -> bool:
        """True once `load()` has succeeded. Never blocks."""

    @abstractmethod
    def count_tokens(self, text: str) -> int:
        """Tokens `text` takes as a memory (used for token budgets). Raises NotReady before `load()`."""

    @abstractmethod
    def layout_prompt(
        self,
        block_texts: Sequence[str],
        text_texts: Sequence[str],
        messages: Sequence[dict[str, str]],
        block_ids: Sequence[int] | None = None,
    ) -> LaidOutPrompt:
        """Lay out `[block: system prompt + block_texts] [client system] [history] [text_texts + last user
        message] [assistant turn start]` as ids (kvmem/kv/layout.py).

        `messages` are OpenAI messages `{"role": "system"|"user"|"assistant", "content": str}` in order. Each
        segment is tokenized separately, so for the same block_texts the block ids are always identical and
        `block_len` is their count (0 when block_texts is empty), and block, client system and history are an
        exact prefix of the next turn's prompt. Deterministic, pure.
        Raises PromptTooLong when `len(ids) >= max_context_tokens` (no room for one new token); serving then
        answers 400. Room for max_tokens is not checked here: serving clamps max_new_tokens to what is left.
        `block_ids`, when given, are the ids `build_block` returned for these block_texts (a plan carries
        them): the block is then not tokenized again.
        """

    @abstractmethod
    def build_block(
        self, user_id: str, block_texts: Sequence[str], memory_ids: Sequence[str] | None = None
    ) -> BuiltBlock:
        """Prefill the block for `block_texts` and store it as a KV item. Blocking (seconds on CPU: call it off
        the request path). Idempotent: the item id is content-addressed, so the same user, texts and model
        give the same id and a second call only returns it. `memory_ids` (parallel to block_texts) are
        recorded in the item so a deletion can find it. Raises BackendError or NotReady."""

    def kv_bytes_per_token(self) -> int | None:
        """What a stored block holds per token (K and V, every layer), once loaded; None: not loaded, or a
        backend that stores no KV. The scheduler sizes a block under a byte quota with it."""
        return None

    def fingerprint_digest(self) -> str | None:
        """The loaded model's fingerprint digest (an adapter trained on another model is not served), or None:
        not loaded, or a backend without one."""
        return None

    def find_block(
        self, user_id: str, block_texts: Sequence[str], memory_ids: Sequence[str]
    ) -> BuiltBlock | None:
        """The stored, valid block for these memories, or None; never prefills (restoring plans at start,
        with `finds_stored_blocks`). Default: none stored."""
        return None

    def stored_memory_ids(self, user_id: str) -> list[tuple[str, ...]]:
        """The memory ids of the user's stored blocks, newest first (restoring plans). Default: none."""
        return []

    def warm_block(self, item_id: str) -> None:
        """Move a stored block to the fastest tier (a session starts: it will be asked for soon). Default:
        nothing to move."""
        return None

    def cut_block(self, item_id: str, memory_ids: Sequence[str], texts: Sequence[str]) -> BuiltBlock | None:
        """Store the block of the first memories of stored block `item_id` (`memory_ids`, a proper prefix of
        its own, with their `texts`) from its K/V, with no prefill; return it (a kvmem BuiltBlock), or None
        when it cannot be cut (the item is gone). Called before a block one of whose later memories changed
        is deleted. Default: None (this backend keeps no K/V to cut from)."""
        return None

    def reload_knowledge(self) -> bool:
        """Switch to the installed shared knowledge if it changed (a stat when it did not), counting
        `knowledge_generation` up; returns whether it switched. Default: no knowledge, never switches."""
        return False

    def forget_adapters(self, user_id: str, adapters: Sequence[str]) -> list[str]:
        """The delete cascade for erased LoRA adapter versions: every stored block of `user_id` built under one
        of `adapters` (served names) is deleted before this returns; their ids, sorted. Default: no block is
        built under an adapter."""
        return []

    def check_response_format(self, fmt: ResponseFormat) -> None:
        """Compile `fmt` for the requests that ask it (a backend listing "response_format" in
        `sampling_features`); raises InvalidResponseFormat saying why it cannot. Default: it cannot."""
        raise InvalidResponseFormat(f"the {self.name} backend serves no response format")

    def use_kv_heat(self, heat: Callable[[str], float]) -> None:
        """`heat(user_id)`: the scheduler's expected reuse of a user's memories, for an engine that evicts by it
        (`--kv-evict-policy heat`); a backend without a page pool ignores it."""
        return None

    def engine_stats(self) -> dict[str, int] | None:
        """The KV page pool's accounting (serving/engine/pages.py: pages_used, shared_bytes, private_bytes,
        ...) for /metrics, or None for a backend without one."""
        return None

    def prefetch_block(self, item_id: str) -> None:
        """A request names this stored block: start bringing it toward the device now, before the request
        waits for its layout and admission (a read from disk into RAM). Never blocks on I/O. Default: nothing."""
        return None

    def kv_tier_stats(self) -> dict | None:
        """Per tier of stored blocks (pool, host, disk): bytes, items, hits, misses, loads, bytes loaded, load
        seconds; the paths taken (load or recompute); the cost model's rates. None for a backend without them."""
        return None

    def block_residency(self, item_id: str) -> dict | None:
        """Where a stored block is and the path a request over it takes ({"tier", "path", "load_s",
        "recompute_s"}), or None for a backend that does not say."""
        return None

    def cancel_builds(self) -> int:
        """Cancel the block builds in flight (a shutdown does not wait for them: a restart rebuilds what it
        needs): each `build_block` under way raises BuildCancelled soon, with nothing stored; builds started
        later run. Returns how many were cancelled. Default: 0, this backend's builds cannot be cancelled."""
        return 0

    @abstractmethod
    def drop_block(self, item_id: str) -> None:
        """Stop serving `item_id` and free it. Requests already using it may finish. Unknown ids are ignored."""

    @abstractmethod
    def has_block(self, item_id: str) -> bool:
        """True while `item_id` is stored and may be served (for the KV store: in its index). Never blocks on
        I/O; False before `load()`."""

    @abstractmethod
    def forget(self, user_id: str, memory_ids: Sequence[str] | None = None) -> list[str]:
        """The delete cascade: every stored block of `user_id` built from any of `memory_ids` (None: all the
        user's blocks), including blocks another process wrote to the data dir, stops being servable before
        this returns; its files are deleted. Works before `load()` too. Returns the item ids, sorted."""

    @abstractmethod
    def subscribe_dropped(self, callback: Callable[[str, str, str], None]) -> Callable[[], None]:
        """Call `callback(item_id, user_id, reason)` whenever the backend drops a stored block on its own
        (reason "evicted", or why it became unusable: "corrupt", "fingerprint_mismatch", "not_found"), on the
        thread that dropped it. Explicit `drop_block`/`forget` calls are not reported. Returns an unsubscribe."""

    @abstractmethod
    def stream(
        self, req: GenerationRequest, is_disconnected: Callable[[], Awaitable[bool]] | None = None
    ) -> AsyncIterator[StreamItem]:
        """Generate: yields TokenDelta items as tokens are produced; the last item is one GenerationResult.

        Implemented as an async generator. Before the first item it may raise QueueFull (the bounded queue is
        full: 429), NotReady (503) or BackendError. It stops early, without raising, when `is_disconnected()`
        returns True or when the consumer closes the generator. Honours max_new_tokens, stop strings and the
        context length (finish_reason "length"). KV fallback is the backend's job: a corrupt or mismatched
        block item means full prefill, `cached_tokens=0`, `kv_fallback_reason` set to its kind
        (KV_FALLBACK_KINDS) and a log line with the detail, never an exception. A block item that is not
        stored raises BlockNotFound before the first item (its texts may be deleted memories: serving prepares
        the request again). `cached_tokens` is the number of prompt tokens served from the KV item: at most the
        block's length, whatever else an engine reused.
        """

    @abstractmethod
    async def aclose(self) -> None:
        """Cancel running generations and free the model. Idempotent."""

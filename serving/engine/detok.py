"""Incremental detokenization: the text of each new token, in time linear in the reply's length.

Decoding the whole reply again at every token (the obvious way) costs O(n) per token, O(n^2) per reply, on
the model thread that serves every stream. Here each token decodes a short window instead: the tokens since
`prefix`, where `prefix` is the start of the last emitted delta's tokens (a little left context, for
tokenizers whose pieces depend on their neighbours) and `read` the end of what was emitted. A delta is the
part of the window's text after the text of tokens [prefix, read); it is emitted only when it is non-empty
and does not end in U+FFFD, i.e. when the window does not end inside a multi-byte UTF-8 character that
later tokens complete (byte-level BPE splits characters across tokens). Held-back tokens just widen the next
window; `flush()` at the end emits whatever is still held (an incomplete character at the very end decodes
to U+FFFD, as the full decode gives it).

Exactness: the concatenated deltas (add ... then flush) equal tokenizer.decode(all ids) for byte-level
tokenizers without space clean-up (the default model's; a property test checks it on random ids, specials
and split characters included). For any tokenizer, a window whose text does not start with its left context's
text (a tokenizer whose decode is not concatenative) is held back too, and flush() reconciles against the
full decode once, so the deltas never contradict it (it logs when it had to).
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, *, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # window start: left context for the next delta
        self._read = 0  # tokens [0, read) are emitted
        self._emitted: list[str] = []
        self.decoded_tokens = 0  # tokens decoded so far, over every window (tests bound it)

    def _decode(self, start: int, end: int | None = None) -> str:
        ids = self.ids[start:end]
        self.decoded_tokens += len(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """The text this token completes ('' while a character or a stable piece is still incomplete)."""
        self.ids.append(int(token_id))
        context = self._decode(self._prefix, self._read)
        text = self._decode(self._prefix)
        if len(text) <= len(context) or text.endswith(_INCOMPLETE) or not text.startswith(context):
            return ""
        delta = text[len(context) :]
        self._prefix, self._read = self._read, len(self.ids)
        self._emitted.append(delta)
        return delta

    def flush(self) -> str:
        """What is still held back, at the end of generation; afterwards the deltas add up to the full decode."""
        if self._read == len(self.ids):
            return ""
        context = self._decode(self._prefix, self._read)
        window = self._decode(self._prefix)
        emitted = "".join(self._emitted)
        full = self._decode(0)
        self._prefix = self._read = len(self.ids)
        if full.startswith(emitted):
            tail = full[len(emitted) :]
        else:  # cannot happen for concatenative decoders (see the module doc); emitted text is not taken back
            log.warning("incremental detokenization diverged from the full decode; tail emitted as decoded")
            tail = window[len(context) :] if window.startswith(context) else window
        self._emitted.append(tail)
        return tail


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: byte -> the printable character a byte-level BPE token spells it with."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


class TokenPieces:
    """Each token's own text and UTF-8 bytes, as OpenAI's logprobs report them. For a byte-level BPE tokenizer
    (the default model's) the bytes are the token's exact bytes, which may be part of a character (its text then
    has U+FFFD where the part is); for others, the bytes of the token decoded alone."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = getattr(backend, "decoder", None)
        self._byte_of: dict[str, int] | None = None
        if decoder is not None and str(decoder).startswith("ByteLevel"):
            self._byte_of = {ch: b for b, ch in _bytes_to_unicode().items()}

    def __call__(self, token_id: int) -> tuple[str, tuple[int, ...]]:
        """(text, bytes) of one token."""
        if self._byte_of is not None:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str) and all(ch in self._byte_of for ch in piece):
                raw = bytes(self._byte_of[ch] for ch in piece)
                return raw.decode("utf-8", errors="replace"), tuple(raw)
        text = self.tokenizer.decode([token_id])
        return text, tuple(text.encode("utf-8", errors="replace"))

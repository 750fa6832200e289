"""Structured outputs: a response format compiled to a token grammar (xgrammar), one matcher per sequence,
and the mask the batched sampler applies to the rows that have one (sampler.py).

A sequence with a grammar gets, at every step that samples it, the set of tokens its grammar allows next
(the matcher fills one row of a packed bitmask, 32 tokens an int32), every other token's logit set to -inf
before its token is chosen (greedy or drawn, after logit_bias and penalties as usual); the chosen token then
advances its matcher. Rows without a grammar are not touched. When the JSON is complete the grammar allows
only the stop tokens given here (the engine's end-of-turn tokens), so a greedy reply ends with "stop".

A reply that runs into `max_new_tokens` is closed, not cut. From `CLOSE_WINDOW` tokens before its budget, each
token the model chooses is checked after the sampler's sync (`Matcher.take`): a short way its document can end
after that token is found (`_closing`: the grammar's forced text, else the first of a few short pieces the
grammar accepts, a closing quote or bracket, a zero, `null`, ..., asked of a copy of the matcher) and spelled
in tokens the grammar accepts one by one. While that closing fits the budget left after the token, the model's
token stands; when it would not, the token is replaced by the next of the closing kept from the step before
(which fitted then), or by a stop token where the document was already complete, and the next step is checked
the same way: the model goes on where it can. The closing is short, not always the shortest in tokens (a
string under `minLength` is filled a character a piece; a tokenizer that adds a leading space spells it a byte
a token), so a reply that would have ended in its last few tokens can be closed a little early; a reply that
ends before its last CLOSE_WINDOW tokens is never touched. The reply is then a complete document that
validates (the closing keeps to the schema: required keys get short values it allows), with "length" as its
finish reason: the model did not end it (a stop string in the closing still ends the reply). A reply with no
closing that fits (a small `max_tokens` under a schema with many required keys) is cut mid-JSON, as OpenAI's
is. A small model under an open schema (`{"type": "object"}`) can add keys until max_tokens; this is what
keeps its reply JSON. The check costs one closing search a row a step (none where the model writes its
closing's next token, two on entering the window), in those last steps only.

Why xgrammar rather than llguidance (both installed; benchmarks/engine/structured_bench.py, the default
model's 49,152-token vocabulary, on the shared 2-core CPU under load, medians, so indicative only): filling
one row's mask took 8-16 us against 155-206 us, eight rows' 57-61 us against 345-527 us, in every run; the
application to the logits is a C++ kernel in xgrammar (0.3 ms a row) while llguidance's torch helper is
compiled by torch.compile at its first call (16-25 s here: a first structured request would stall the
engine), after which its cost varied from 0.17 to 100 ms between runs on this machine. Compiling a schema:
8-26 ms with xgrammar quiet or loaded (the tokenizer's table built once, 0.2-1.8 s), 2-30 ms with
llguidance (its table 0.6-6 s). The fill is paid for every constrained row at every step, so it decides; the
quiet-machine figures are the command in that script's docstring.

JSON is generated compact (no whitespace between tokens: `{"a":1}`): a small model allowed any whitespace
can write newlines until `max_tokens` instead of the next key. Knows nothing of HTTP or backends.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence

import torch

log = logging.getLogger(__name__)

MAX_SCHEMA_CHARS = 100_000  # a schema's JSON text; a longer one is refused before it is compiled
CACHE_SIZE = 256  # compiled grammars kept, least recently used dropped
CLOSE_WINDOW = 64  # tokens before max_new_tokens from which every token taken is checked: a closing fits
CLOSE_PIECES = 96  # pieces a closing may have (each one forced text, or one short piece), else none is found
# what a closing tries where the grammar forces nothing, in order; each is accepted by the search's copy of
# the matcher or skipped: end a string, then close, then the shortest values, then separators, then any
# printable character (a string under a pattern or an enum); a second order tries brackets first (shorter
# outside a string, never ending inside one: a bracket there is the string's text, and the search runs out of
# pieces, or out of its bound: no shorter than the first order's)
_QUOTE_FIRST = ('"', "}", "]", "0", "null", "false", "[]", "{}", ",", ":") + tuple(map(chr, range(32, 127)))
_BRACKET_FIRST = ("}", "]") + _QUOTE_FIRST


class GrammarError(ValueError):
    """A response format the grammar compiler cannot compile; the message says why."""


class Grammar:
    """A compiled response format; `matcher()` gives a sequence its own state over it."""

    def __init__(self, compiled, speller: Speller | None = None) -> None:
        self._compiled, self._speller = compiled, speller

    def matcher(self) -> Matcher:
        import xgrammar as xgr

        return Matcher(xgr.GrammarMatcher(self._compiled), self._speller)


class Matcher:
    """One sequence's place in its grammar: the tokens allowed next, and each token taken. With a speller, a
    reply near its budget is kept closable (the module's docstring): `closed_early` says a token of its was
    replaced by its closing's."""

    __slots__ = ("_m", "_speller", "_plan", "_known", "closed_early")

    def __init__(self, matcher, speller: Speller | None = None) -> None:
        self._m, self._speller = matcher, speller
        self._plan: list[int] | None = None  # the closing from here ([]: complete; None: none found) ...
        self._known = False  # ... once known (in the window)
        self.closed_early = False

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Row `row` of `bitmask`: the tokens its grammar allows next."""
        self._m.fill_next_token_bitmask(bitmask, row)

    def take(self, token: int, remaining: int | None = None) -> int | None:
        """Advance by the chosen `token` and return the token taken: `token`, or, within CLOSE_WINDOW tokens
        of the budget (`remaining`: the tokens the reply may still write, this one included; None: no budget),
        its closing's next token (a stop token once the document is complete) where `token` would leave no
        closing that fits. None: the grammar does not allow `token` (the matcher is unchanged)."""
        if remaining is not None and remaining <= CLOSE_WINDOW and self._speller is not None:
            try:
                token = self._vet(token, remaining)
            except Exception:  # noqa: BLE001 - the closing never fails a step: the model's token stands
                log.exception("structured outputs: the closing check failed; the model's token stands")
                self._known = False
        else:
            self._known = False
        return token if self._m.accept_token(token) else None

    def accept(self, token: int) -> bool:
        """Advance by `token` (no budget); False if the grammar does not allow it (the matcher is
        unchanged)."""
        return self.take(token) is not None

    @property
    def terminated(self) -> bool:
        return self._m.is_terminated()

    def closing_tokens(self) -> list[int] | None:
        """The tokens that would end its document from here, in order ([] once it is complete; None: no
        closing found, or no speller); the matcher is unchanged."""
        return None if self._speller is None else _closing_tokens(self._m, self._speller)

    def _vet(self, token: int, remaining: int) -> int:
        if not self._known:  # entering the window
            self._plan, self._known = self.closing_tokens(), True
        plan = self._plan
        fits = plan is not None and len(plan) <= remaining
        if fits and plan and token == plan[0]:  # the model writes its closing's next token: the rest fits
            self._plan = plan[1:]
            return token
        after = self._m.fork()
        if not after.accept_token(token) or after.is_terminated():  # not allowed (take refuses it), or a stop
            return token
        then = _closing_tokens(after, self._speller)
        if (then is not None and len(then) <= remaining - 1) or not fits:  # it fits after the token, or
            self._plan = then  # nothing fitted before it either: the model's token stands
            return token
        self.closed_early = True  # the closing from here (it fits) goes on, or the complete document stops
        if plan:
            self._plan = plan[1:]
            return plan[0]
        self._plan = []
        return self._speller.stop if self._speller.stop is not None else token


def _closing_tokens(matcher, speller: Speller) -> list[int] | None:
    text = _closing(matcher)
    return None if text is None else speller.spell(text, matcher)


def _closing(matcher) -> str | None:
    """A short text that completes `matcher`'s document ("" if it is complete; None: none found); the
    xgrammar GrammarMatcher is unchanged. Each order of pieces is searched greedily, the shorter result kept
    (the second search gives up once it is no shorter than the first's)."""
    best = None
    for pieces in (_QUOTE_FIRST, _BRACKET_FIRST):
        text = _close(matcher, pieces, None if best is None else len(best))
        if text is not None and (best is None or len(text) < len(best)):
            best = text
    return best


def _close(matcher, pieces: tuple[str, ...], bound: int | None) -> str | None:
    """The greedy closing in the order `pieces`; None where none is found within CLOSE_PIECES pieces, or none
    shorter than `bound` characters."""
    state, out, size = matcher.fork(), [], 0
    for _ in range(CLOSE_PIECES):
        if state.is_completed():
            return "".join(out)
        if bound is not None and size >= bound:
            return None
        forced = state.find_jump_forward_string()
        if forced:
            state.accept_string(forced)
            out.append(forced)
            size += len(forced)
            continue
        for piece in pieces:
            if state.accept_string(piece):  # a piece refused leaves the state as it was
                out.append(piece)
                size += len(piece)
                break
        else:
            return None
    return None


class Speller:
    """A closing's text as token ids the grammar accepts in order: the tokenizer's own encoding, or one
    single-byte token a byte where that encoding does not spell the same bytes (a tokenizer that adds a
    leading space); `stop` the token that ends a complete reply. Its table is built whole at construction
    (under the compiler's lock), so threads never see it half made."""

    def __init__(self, tokenizer, decoded_vocab: Sequence[bytes], stop_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self.stop = stop_token_ids[0] if stop_token_ids else None
        table: dict[int, int] = {}
        for token, spelled in enumerate(decoded_vocab):
            if len(spelled) == 1:
                table.setdefault(spelled[0], token)
        self._bytes = table

    def spell(self, text: str, matcher) -> list[int] | None:
        ids = self._tokenizer.encode(text, add_special_tokens=False)
        if _accepts(matcher, ids):
            return ids
        ids = [self._bytes.get(b) for b in text.encode()]
        return ids if None not in ids and _accepts(matcher, ids) else None


def _accepts(matcher, ids: Sequence[int]) -> bool:
    trial = matcher.fork()
    return all(trial.accept_token(t) for t in ids) and trial.is_completed()


class Grammars:
    """Compiles response formats for one tokenizer: `vocab_size` is the width of the model's logits (it may
    exceed the tokenizer's own vocabulary: those ids are never allowed), `stop_token_ids` the tokens that end
    a reply once its JSON is complete. Thread-safe; the tokenizer's table is built at the first compile."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self._tokenizer, self.vocab_size, self._stops = tokenizer, vocab_size, sorted(stop_token_ids)
        self._compiler = None
        self._speller: Speller | None = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str | None], Grammar] = OrderedDict()

    def _get_compiler(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self.vocab_size, stop_token_ids=self._stops
                )
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
                self._speller = Speller(self._tokenizer, info.decoded_vocab, self._stops)
            return self._compiler

    def compile(self, kind: str, schema: str | None = None) -> Grammar:
        """`kind` "json_object" (any JSON object) or "json_schema" (`schema`: the schema as JSON text). Raises
        GrammarError for a schema that is not a JSON object, is too long, or that the compiler refuses."""
        key = (kind, schema)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        compiler = self._get_compiler()
        if kind == "json_object":
            compiled = compiler.compile_grammar(_object_grammar())
        elif kind == "json_schema":
            compiled = compiler.compile_json_schema(_checked(schema), **_COMPACT)
        else:
            raise GrammarError(f"unknown response format type {kind!r}")
        if not _starts(compiled, self.vocab_size):
            raise GrammarError(
                "the response format admits no JSON document: its grammar allows no first token (a schema "
                "that only refers to itself, or whose constraints contradict each other)"
            )
        grammar = Grammar(compiled, self._speller)
        with self._lock:
            self._cache[key] = grammar
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar


_COMPACT = {"any_whitespace": False, "separators": (",", ":")}


def _starts(compiled, vocab_size: int) -> bool:
    """Whether the compiled grammar allows some first token."""
    import xgrammar as xgr

    probe = xgr.allocate_token_bitmask(1, vocab_size)
    xgr.GrammarMatcher(compiled).fill_next_token_bitmask(probe, 0)
    return bool(probe.any())


def _object_grammar():
    """xgrammar's builtin JSON grammar rooted at an object: json_object's reply is one object, as OpenAI's
    (the builtin's own root also takes an array). Its whitespace is kept: the compact `{"type": "object"}`
    schema made the default model nest an object where it wrote `{"city": "Paris"}` with it."""
    import xgrammar as xgr

    root = '\nobject_root ::= "{" [ \\n\\r\\t]* members_and_embrace\n'
    rooted = str(xgr.Grammar.builtin_json_grammar()) + root
    return xgr.Grammar.from_ebnf(rooted, root_rule_name="object_root")


def _checked(schema: str | None) -> str:
    if schema is None:
        raise GrammarError("a json_schema response format needs a schema")
    if len(schema) > MAX_SCHEMA_CHARS:
        raise GrammarError(f"the schema has {len(schema)} characters, over the limit of {MAX_SCHEMA_CHARS}")
    try:
        parsed = json.loads(schema)
    except ValueError as exc:
        raise GrammarError(f"the schema is not JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise GrammarError(f"the schema must be a JSON object, got {type(parsed).__name__}")
    try:
        import xgrammar as xgr

        xgr.Grammar.from_json_schema(schema, **_COMPACT)  # the compiler's own check, without the token table
    except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError with its reason
        raise GrammarError(_reason(exc)) from None
    return schema


def _reason(exc: Exception) -> str:
    """xgrammar's message without its log prefix ("[12:28:00] /project/cpp/x.cc:83: ")."""
    lines = str(exc).strip().splitlines()
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", lines[0]) if lines else type(exc).__name__


def mask(logits: torch.Tensor, rows: Sequence[tuple[int, Matcher]]) -> list[int]:
    """Set to -inf, in place, every logit of row i that matcher does not allow next, for each (i, matcher);
    other rows are untouched. `logits` [rows, vocab] float32 (the step's own copy), on any device: the
    matchers fill the bitmask on the host, and it is copied to the logits' device (xgrammar applies it
    only where both are; on CUDA with its Triton kernel, or torch's ops where Triton is not installed).
    Returns the rows i whose matcher allows no token at all (a grammar that dead-ends), read on the host."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(rows), logits.shape[1])
    for j, (_, matcher) in enumerate(rows):
        matcher.fill(bitmask, j)
    dead = [i for (i, _), alive in zip(rows, bitmask.any(dim=1).tolist(), strict=True) if not alive]
    backend = "auto"
    if logits.device.type != "cpu":
        bitmask = bitmask.to(logits.device)
        if logits.device.type == "cuda" and not _has_triton():
            backend = "torch_native"
    index = [i for i, _ in rows]
    if index == list(range(logits.shape[0])):
        xgr.apply_token_bitmask_inplace(logits, bitmask, backend=backend)
        return dead
    sub = logits[index]
    xgr.apply_token_bitmask_inplace(sub, bitmask, backend=backend)
    logits[index] = sub
    return dead


@functools.cache
def _has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None

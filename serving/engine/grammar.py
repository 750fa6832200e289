"""Structured outputs: a response format compiled to a token grammar (xgrammar), one matcher per sequence,
and the mask the batched sampler applies to the rows that have one (sampler.py).

A sequence with a grammar gets, at every step that samples it, the set of tokens its grammar allows next
(the matcher fills one row of a packed bitmask, 32 tokens an int32), every other token's logit set to -inf
before its token is chosen (greedy or drawn, after logit_bias and penalties as usual); the chosen token then
advances its matcher. Rows without a grammar are not touched. When the JSON is complete the grammar allows
only the stop tokens given here (the engine's end-of-turn tokens), so a greedy reply ends with "stop"; a
reply cut by `max_new_tokens` ends mid-JSON with "length", as OpenAI's does.

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

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence

import torch

MAX_SCHEMA_CHARS = 100_000  # a schema's JSON text; a longer one is refused before it is compiled
CACHE_SIZE = 256  # compiled grammars kept, least recently used dropped


class GrammarError(ValueError):
    """A response format the grammar compiler cannot compile; the message says why."""


class Grammar:
    """A compiled response format; `matcher()` gives a sequence its own state over it."""

    def __init__(self, compiled) -> None:
        self._compiled = compiled

    def matcher(self) -> Matcher:
        import xgrammar as xgr

        return Matcher(xgr.GrammarMatcher(self._compiled))


class Matcher:
    """One sequence's place in its grammar: the tokens allowed next, and each token accepted."""

    __slots__ = ("_m",)

    def __init__(self, matcher) -> None:
        self._m = matcher

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        """Advance by `token`; False if the grammar does not allow it (the matcher is unchanged)."""
        return self._m.accept_token(token)

    @property
    def terminated(self) -> bool:
        return self._m.is_terminated()


class Grammars:
    """Compiles response formats for one tokenizer: `vocab_size` is the width of the model's logits (it may
    exceed the tokenizer's own vocabulary: those ids are never allowed), `stop_token_ids` the tokens that end
    a reply once its JSON is complete. Thread-safe; the tokenizer's table is built at the first compile."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self._tokenizer, self.vocab_size, self._stops = tokenizer, vocab_size, sorted(stop_token_ids)
        self._compiler = None
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
            compiled = compiler.compile_builtin_json_grammar()
        elif kind == "json_schema":
            compiled = compiler.compile_json_schema(_checked(schema), **_COMPACT)
        else:
            raise GrammarError(f"unknown response format type {kind!r}")
        grammar = Grammar(compiled)
        with self._lock:
            self._cache[key] = grammar
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar


_COMPACT = {"any_whitespace": False, "separators": (",", ":")}


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


def mask(logits: torch.Tensor, rows: Sequence[tuple[int, Matcher]]) -> None:
    """Set to -inf, in place, every logit of row i that matcher does not allow next, for each (i, matcher);
    other rows are untouched. `logits` [rows, vocab] float32 (the step's own copy)."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(rows), logits.shape[1])
    for j, (_, matcher) in enumerate(rows):
        matcher.fill(bitmask, j)
    index = [i for i, _ in rows]
    if index == list(range(logits.shape[0])):
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        return
    sub = logits[index]
    xgr.apply_token_bitmask_inplace(sub, bitmask)
    logits[index] = sub

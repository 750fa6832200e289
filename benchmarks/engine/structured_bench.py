"""Structured outputs (issue 45 item 1): schema-valid replies on 50 schemas, and what the token mask costs.

1. Replies: each schema of benchmarks/data/structured/schemas.json (nested objects, enums, arrays, integers
   and numbers with bounds, strings with patterns) with its prompt, greedy, `--max-tokens` at most, through the
   transformers backend on the default model, `--concurrency` requests at a time (they share decode steps,
   so constrained rows are masked in batches); each reply is parsed and validated with `jsonschema`. A reply
   that ran into max_tokens was closed by the engine (serving/engine/grammar.py) and counts as it validates;
   `closed_early` counts them (valid, finish "length"); one cut mid-JSON counts as invalid. The schema's
   compile time (`check_response_format`, the first one also builds the tokenizer's table) is recorded.
2. The mask inside the engine: every call of serving/engine/grammar.py's `mask` during (1) timed, with its
   row count (fill + apply, per step); and every closing check (`Matcher.take` on a row within CLOSE_WINDOW
   tokens of its budget, one row each).
3. xgrammar against llguidance, alone: `--repeats` walks through the tokens of the first replies of (1), at 1
   and at 8 rows, the fill of every row's bitmask and its application to a [rows, vocab] float32 logits
   tensor timed apart, per step; and each one's compile time for every schema.

Counts (valid replies) can be taken on a busy machine; timings only on a quiet one. Smoke (busy machine):

    python -m benchmarks.engine.structured_bench --limit 4 --repeats 1 --out /tmp/structured.json

The figure (a quiet machine, ~10 minutes on 2 cores):

    python -m benchmarks.engine.structured_bench --out benchmarks/results/cpu/structured.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

import jsonschema
import torch

from benchmarks.common import env_info, median, p90, print_table, write_outputs
from serving.engine.grammar import CLOSE_WINDOW

SCHEMAS = Path(__file__).resolve().parents[1] / "data" / "structured" / "schemas.json"


def load_backend(model: str | None, data_dir: str):
    from kvmem.models import provision
    from serving.backends.transformers.backend import TransformersBackend, TransformersBackendConfig

    backend = TransformersBackend(
        TransformersBackendConfig(model=model or str(provision()), data_dir=data_dir, dtype="float32")
    )
    backend.load()
    return backend


async def reply(backend, case: dict, max_tokens: int) -> dict:
    from serving.backends.base import GenerationRequest, ResponseFormat, SamplingParams, TokenDelta

    fmt = ResponseFormat("json_schema", json.dumps(case["schema"]), case["name"])
    started = time.perf_counter()
    await asyncio.to_thread(backend.check_response_format, fmt)
    compile_s = time.perf_counter() - started
    prompt = backend.layout_prompt([], [], [{"role": "user", "content": case["prompt"]}])
    sampling = SamplingParams(max_new_tokens=max_tokens, temperature=0.0, response_format=fmt)
    ids, text, finish = [], [], None
    async for item in backend.stream(GenerationRequest(case["name"], "bench", prompt, None, sampling)):
        if isinstance(item, TokenDelta):
            ids.extend(item.token_ids)
            text.append(item.text)
        else:
            finish = item.finish_reason
    out = {"name": case["name"], "tokens": len(ids), "finish_reason": finish, "compile_s": compile_s}
    try:
        jsonschema.validate(json.loads("".join(text)), case["schema"])
        out["valid"] = True
    except (ValueError, jsonschema.ValidationError) as exc:
        out["valid"], out["error"] = False, str(exc).splitlines()[0][:200]
    out["text"], out["ids"] = "".join(text), ids
    print(f"{case['name']}: valid={out['valid']} {finish} {len(ids)} tokens", file=sys.stderr, flush=True)
    return out


async def all_replies(backend, cases: list[dict], max_tokens: int, concurrency: int) -> list[dict]:
    gate = asyncio.Semaphore(concurrency)

    async def one(case):
        async with gate:
            return await reply(backend, case, max_tokens)

    return await asyncio.gather(*(one(c) for c in cases))


def engine_mask_timer():
    """Wrap grammar.mask: (rows, seconds) of every call; and Matcher.take within CLOSE_WINDOW of a budget (the
    closing checks): ("take", seconds)."""
    from serving.engine import grammar, sampler

    calls: list[tuple[int | str, float]] = []
    real, real_take = grammar.mask, grammar.Matcher.take

    def timed(logits, rows):
        t = time.perf_counter()
        real(logits, rows)
        calls.append((len(rows), time.perf_counter() - t))

    def timed_take(self, token, remaining=None):
        t = time.perf_counter()
        out = real_take(self, token, remaining)
        if remaining is not None and remaining <= grammar.CLOSE_WINDOW:
            calls.append(("take", time.perf_counter() - t))
        return out

    def restore():
        sampler.grammar.mask = real
        grammar.Matcher.take = real_take

    sampler.grammar.mask = timed
    grammar.Matcher.take = timed_take
    return calls, restore


def walk_xgrammar(tokenizer, vocab: int, stops, schema: str, ids: list[int], rows: int) -> tuple[list, list]:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=sorted(stops))
    compiled = xgr.GrammarCompiler(info, max_threads=1).compile_json_schema(
        schema, any_whitespace=False, separators=(",", ":")
    )
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(rows)]
    logits = torch.randn(rows, vocab)
    fills, applies = [], []
    for token in ids:
        bitmask = xgr.allocate_token_bitmask(rows, vocab)
        t0 = time.perf_counter()
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, i)
        t1 = time.perf_counter()
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        t2 = time.perf_counter()
        fills.append(t1 - t0)
        applies.append(t2 - t1)
        for m in matchers:
            if not m.accept_token(token):
                raise RuntimeError(f"xgrammar refused token {token}")
    return fills, applies


def walk_llguidance(tokenizer, vocab: int, schema: str, ids: list[int], rows: int) -> tuple[list, list]:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    lt = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    matchers = [llguidance.LLMatcher(lt, grammar) for _ in range(rows)]
    logits = torch.randn(rows, vocab)
    fills, applies = [], []
    for token in ids:
        bitmask = llguidance.torch.allocate_token_bitmask(rows, vocab)
        t0 = time.perf_counter()
        for i, m in enumerate(matchers):
            llguidance.torch.fill_next_token_bitmask(m, bitmask, i)
        t1 = time.perf_counter()
        llguidance.torch.apply_token_bitmask_inplace(logits, bitmask)
        t2 = time.perf_counter()
        fills.append(t1 - t0)
        applies.append(t2 - t1)
        for m in matchers:
            if not m.consume_token(token):
                raise RuntimeError(f"llguidance refused token {token}: {m.get_error()}")
    return fills, applies


def compile_times(tokenizer, vocab: int, stops, schemas: list[str]) -> dict:
    out = {}
    import xgrammar as xgr

    t = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=sorted(stops))
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    table = time.perf_counter() - t
    per = []
    for s in schemas:
        t = time.perf_counter()
        compiler.compile_json_schema(s, any_whitespace=False, separators=(",", ":"))
        per.append(time.perf_counter() - t)
    out["xgrammar"] = {
        "tokenizer_table_s": table,
        "compile_ms_median": median(per) * 1e3,
        "compile_ms_p90": p90(per) * 1e3,
    }
    try:
        import llguidance
        import llguidance.hf
    except ImportError:
        return out
    t = time.perf_counter()
    lt = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    table = time.perf_counter() - t
    per = []
    for s in schemas:
        t = time.perf_counter()
        m = llguidance.LLMatcher(
            lt, llguidance.LLMatcher.grammar_from_json_schema(s, defaults={"whitespace_flexible": False})
        )
        per.append(time.perf_counter() - t)
        assert not m.is_error(), m.get_error()
    out["llguidance"] = {
        "tokenizer_table_s": table,
        "compile_ms_median": median(per) * 1e3,
        "compile_ms_p90": p90(per) * 1e3,
    }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model dir (default: the provisioned default model)")
    ap.add_argument("--limit", type=int, default=None, help="the first N schemas only (a smoke run)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3, help="replies walked per backend and row count")
    ap.add_argument("--data-dir", default="/tmp/kvmem-structured-bench")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    env = env_info()  # the load average before this run's own work
    cases = json.loads(SCHEMAS.read_text())[: args.limit]
    backend = load_backend(args.model, args.data_dir)
    calls, restore = engine_mask_timer()
    try:
        replies = asyncio.run(all_replies(backend, cases, args.max_tokens, args.concurrency))
    finally:
        restore()
    valid = sum(r["valid"] for r in replies)
    print_table(
        ["schema", "valid", "finish", "tokens", "compile ms"],
        [(r["name"], r["valid"], r["finish_reason"], r["tokens"], r["compile_s"] * 1e3) for r in replies],
    )
    engine = {}
    for rows in sorted({n for n, _ in calls if n != "take"}):
        secs = [s for n, s in calls if n == rows]
        engine[str(rows)] = {"steps": len(secs), "median_us": median(secs) * 1e6, "p90_us": p90(secs) * 1e6}
    takes = [s for n, s in calls if n == "take"]
    closing_checks = {"calls": len(takes)}
    if takes:
        closing_checks.update(median_us=median(takes) * 1e6, p90_us=p90(takes) * 1e6, max_us=max(takes) * 1e6)
    print(f"closing checks (a row's token within the last {CLOSE_WINDOW} of its budget): {closing_checks}")
    tok, vocab, stops = backend.handle.tokenizer, backend.vocab_size, backend._eos
    walks: dict = {}
    done = [r for r in replies if r["valid"]][: args.repeats]
    for name, walk in (
        ("xgrammar", lambda s, ids, rows: walk_xgrammar(tok, vocab, stops, s, ids, rows)),
        ("llguidance", lambda s, ids, rows: walk_llguidance(tok, vocab, s, ids, rows)),
    ):
        for rows in (1, 8):
            fills, applies = [], []
            for r in done:
                schema = json.dumps(next(c["schema"] for c in cases if c["name"] == r["name"]))
                try:
                    f, a = walk(schema, r["ids"], rows)
                except ImportError:
                    break
                fills += f
                applies += a
            if fills:
                walks[f"{name}_{rows}_rows"] = {
                    "steps": len(fills),
                    "fill_us_median": median(fills) * 1e6,
                    "apply_us_median": median(applies) * 1e6,
                    "fill_plus_apply_us_median": median([f + a for f, a in zip(fills, applies, strict=True)])
                    * 1e6,
                }
    compiles = compile_times(tok, vocab, stops, [json.dumps(c["schema"]) for c in cases])
    print_table(
        ["mask", "steps", "fill us", "apply us"],
        [(k, v["steps"], v["fill_us_median"], v["apply_us_median"]) for k, v in walks.items()],
    )
    result = {
        "env": env,
        "args": vars(args),
        "schemas": len(cases),
        "valid": valid,
        "valid_fraction": valid / len(cases) if cases else None,
        "finish_reasons": {k: sum(r["finish_reason"] == k for r in replies) for k in ("stop", "length")},
        "closed_early": sum(r["valid"] and r["finish_reason"] == "length" for r in replies),
        "reply_tokens_median": statistics.median(r["tokens"] for r in replies) if replies else None,
        "engine_mask_by_rows": engine,
        "closing_checks": closing_checks,
        "mask_walks": walks,
        "compile": compiles,
        "replies": [{k: v for k, v in r.items() if k != "ids"} for r in replies],
        "pid": os.getpid(),
    }
    asyncio.run(backend.aclose())
    write_outputs(result, args.out)


if __name__ == "__main__":
    main()

"""A formation row's delay to chat rows (issue 45 item 2), counted in engine steps under 8 streaming clients.

The budget (serving/engine/batcher.py): a chat row is in every step from its admission to its end (0 steps of
delay); a step holds at most one formation (background) row, whose prefill chunk is at most 16 tokens while
chat rows decode; formation rows take no step while a chat row waits to be admitted again.

Run: `--clients` chat requests of different lengths streamed at once through the transformers backend on the
default model, greedy, twice: alone, then with `--formation` background requests (an extraction prompt
under the facts schema, as `--extractor self` sends) started just before them. Every engine step is
recorded. Reported: steps in which a live chat row was left out (the delay, must be 0), the most formation
rows in one step with chat rows, the largest formation prefill chunk in a step where chat rows decode,
whether every chat reply has the same tokens as without formation, the steps each chat request took with and
without, the wall time of both runs and the time to the last chat reply's last token in each (timings only on a
quiet machine). Smoke (busy machine):

    python -m benchmarks.engine.formation_priority --clients 3 --max-tokens 8 --out /tmp/formation_priority.json

The figure:

    python -m benchmarks.engine.formation_priority --out benchmarks/results/cpu/formation_priority.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from benchmarks.common import env_info, print_table, write_outputs
from kvmem.formation.self_model import FACTS_SCHEMA
from serving.backends.base import GenerationRequest, ResponseFormat, SamplingParams, TokenDelta
from serving.engine import batcher as batcher_module

QUESTIONS = [
    "Hi",
    "What is the capital of France?",
    "Tell me a short story about a cat.",
    "List three colours.",
    "Why is the sky blue? Explain in detail.",
    "Give me a recipe for pancakes.",
    "What is two plus two?",
    "Write a haiku about the sea.",
]
LOG = (
    "Chat log, oldest first:\n[2026-11-20 Fri] user: I quit my job at Acme last week and now I work as a nurse.\n"
    "[2026-11-20 Fri] assistant: Congratulations!\n[2026-11-21 Sat] user: My sister Rita moved to Porto."
)


def make(backend, name, content, max_new, background=False, fmt=None) -> GenerationRequest:
    prompt = backend.layout_prompt([], [], [{"role": "user", "content": content}])
    sampling = SamplingParams(max_new_tokens=max_new, temperature=0.0, response_format=fmt)
    return GenerationRequest(name, "bench", prompt, None, sampling, background=background)


async def stream_ids(backend, req) -> list[int]:
    ids = []
    async for item in backend.stream(req):
        if isinstance(item, TokenDelta):
            ids.extend(item.token_ids)
    return ids


def run(backend, requests) -> tuple[list[list[int]], list, float, list[float]]:
    """Every request at once; (their token ids, the steps [(rows, live chat)], seconds, each request's seconds to
    its last token)."""
    record: list = []
    real = batcher_module.runner.step
    batcher = backend._loop._batcher
    names = {tuple(r.prompt.ids): r.request_id for r in requests}

    def recording(model, pool, prefills, decodes):
        live = {names[tuple(s.prompt_ids)] for s in batcher._members if not s.background and not s.finished}
        rows = [(names[tuple(s.prompt_ids)], s.next_chunk_tokens(), s.background) for s in prefills]
        rows += [(names[tuple(s.prompt_ids)], "d", s.background) for s in decodes]
        record.append((rows, live))
        return real(model, pool, prefills, decodes)

    async def timed(req) -> tuple[list[int], float]:
        ids = await stream_ids(backend, req)
        return ids, time.perf_counter() - started

    async def together():
        return await asyncio.gather(*(timed(r) for r in requests))

    batcher_module.runner.step = recording
    try:
        started = time.perf_counter()
        done = asyncio.run(together())
        return [i for i, _ in done], record, time.perf_counter() - started, [s for _, s in done]
    finally:
        batcher_module.runner.step = real


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--formation", type=int, default=2, help="background formation requests")
    ap.add_argument("--max-tokens", type=int, default=48, help="the longest chat reply (others shorter)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    env = env_info()
    from kvmem.models import provision
    from serving.backends.transformers.backend import TransformersBackend, TransformersBackendConfig

    backend = TransformersBackend(
        TransformersBackendConfig(
            model=str(provision()), data_dir="/tmp/kvmem-formation-priority", dtype="float32"
        )
    )
    backend.load()
    fmt = ResponseFormat("json_schema", json.dumps(FACTS_SCHEMA), "facts")
    backend.check_response_format(fmt)
    chats = [
        make(
            backend,
            f"chat{i}",
            QUESTIONS[i % len(QUESTIONS)] + " " * (i // len(QUESTIONS)),
            max(2, args.max_tokens - 5 * i),
        )
        for i in range(args.clients)
    ]
    formations = [
        make(backend, f"form{i}", LOG + f" ({i})", 96, background=True, fmt=fmt)
        for i in range(args.formation)
    ]
    alone_ids, alone_steps, alone_s, alone_done = run(backend, chats)
    with_ids, steps, with_s, with_done = run(backend, formations + chats)
    chat_names = {r.request_id for r in chats}
    left_out = sum(len(live - {n for n, _, _ in rows}) for rows, live in steps)
    with_chat = [rows for rows, live in steps if live]
    most_background = max((sum(b for _, _, b in rows) for rows in with_chat), default=0)
    chunks = [
        c
        for rows in with_chat
        if any(c == "d" for n, c, _ in rows if n in chat_names)
        for _, c, b in rows
        if b and c != "d"
    ]

    def steps_of(record, name):
        return sum(1 for rows, _ in record if any(n == name for n, _, _ in rows))

    per_chat = [
        (r.request_id, steps_of(alone_steps, r.request_id), steps_of(steps, r.request_id)) for r in chats
    ]
    print_table(["chat", "steps alone", "steps with formation"], per_chat)
    result = {
        "env": env,
        "args": vars(args),
        "budget": {"background_rows_per_step": 1, "background_chunk_tokens_while_chat_decodes": 16},
        "chat_rows_left_out_of_a_step": left_out,
        "most_formation_rows_in_a_step_with_chat": most_background,
        "largest_formation_chunk_while_chat_decodes": max(chunks, default=0),
        "chat_tokens_identical": with_ids[len(formations) :] == alone_ids,
        "formation_tokens": [len(i) for i in with_ids[: len(formations)]],
        "steps_per_chat": [{"name": n, "alone": a, "with_formation": w} for n, a, w in per_chat],
        "steps_total": {"alone": len(alone_steps), "with_formation": len(steps)},
        "wall_s": {"alone": alone_s, "with_formation": with_s},
        # the wall-clock cost to chats of the formation rows' work in their steps (timings only on a quiet machine)
        "last_chat_token_s": {"alone": max(alone_done), "with_formation": max(with_done[len(formations) :])},
    }
    asyncio.run(backend.aclose())
    write_outputs(result, args.out)


if __name__ == "__main__":
    main()

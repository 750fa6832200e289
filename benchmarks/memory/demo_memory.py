"""The README's demo, measured through HTTP: does the bot answer the demo user's questions from memory?

Run: python -m benchmarks.memory.demo_memory --out benchmarks/results/cpu/demo_memory.json [--model DIR]
Spawns `kvmem serve --no-auth --demo` (what scripts/run.sh starts; turns logged and formed by the default
rules extractor) on loopback, waits for the demo user's KV block, and asks, at temperature 0:
1. the five questions about the seeded memories (an answer counts when it contains the expected word);
2. a formation round: a little chit-chat, then "I moved to Berlin last month." and "My cat is called Pixel.";
   once formed, "Where do I live?" (expects Berlin) and "What is my cat called?" (Pixel);
3. the share of the KV block's tokens that come from assistant replies or chit-chat (0 by design).
Prints a table; the last stdout line is one JSON document (git sha, load average, model, every answer).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import urllib.request
from pathlib import Path

from benchmarks.common import git_sha, write_outputs
from benchmarks.load.http_client import spawned_server, wait_for_block
from serving.background.startup import DEMO_MEMORIES

USER = "demo"
QUESTIONS = (  # (question, a word the answer must contain), about serving.background.startup.DEMO_MEMORIES
    ("What is my dog called?", "miso"),
    ("Where do I live?", "lisbon"),
    ("What am I allergic to?", "peanut"),
    ("What do I do for work?", "marine"),
    ("What is my favourite programming language?", "python"),
)
CHIT_CHAT = ("Hi there!", "Thanks, that's helpful.", "ok")
STATEMENTS = ("I moved to Berlin last month.", "My cat is called Pixel.")
FORMED_QUESTIONS = (("Where do I live?", "berlin"), ("What is my cat called?", "pixel"))


def _call(base: str, path: str, body: dict | None = None, method: str | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        f"{base}{path}", data=data, method=method, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as r:  # noqa: S310 - loopback only
        return json.loads(r.read())


def ask(base: str, question: str, max_tokens: int, model: str) -> dict:
    body = {
        "model": model,
        "user": USER,
        "temperature": 0,
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": question}],
    }
    out = _call(base, "/v1/chat/completions", body)
    return {
        "question": question,
        "answer": out["choices"][0]["message"]["content"],
        "cached_tokens": out["usage"]["prompt_tokens_details"]["cached_tokens"],
        "memory_used": out["memory"]["used"],
    }


def wait_formed(base: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _call(base, f"/v1/memories/formation?user_id={USER}")["pending"] == 0:
            return
        time.sleep(0.25)
    raise RuntimeError(f"formation still pending after {timeout_s} s")


def block_sources(base: str) -> dict:
    """Tokens (the plan's own count, split by memory text length) of the block by where its memories came
    from: seeded or formed user statements vs assistant replies or chit-chat."""
    plan = _call(base, f"/v1/memories/plan?user_id={USER}")
    block = plan["block"] or {"memory_ids": [], "num_tokens": 0}
    by_id = {m["id"]: m for m in _call(base, f"/v1/memories?user_id={USER}&page_size=100")["data"]}
    bad = [
        i
        for i in block["memory_ids"]
        if by_id[i]["role"] == "assistant" or by_id[i]["text"].strip() in CHIT_CHAT
    ]
    return {
        "block_memory_ids": block["memory_ids"],
        "block_texts": [by_id[i]["text"] for i in block["memory_ids"] if i in by_id],
        "num_block_memories_from_assistant_or_chit_chat": len(bad),
        "share_of_block_from_assistant_or_chit_chat": len(bad) / max(1, len(block["memory_ids"])),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model dir or id (default: the server's default)")
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    with (
        tempfile.TemporaryDirectory() as tmp,
        spawned_server(
            backend="transformers",
            model=args.model,
            block_budget=2048,
            top_k=8,
            data_dir=f"{tmp}/data",
            extra=("--demo",),
            store_turns=True,
        ) as base,
    ):
        wait_for_block(base, USER, expected=len(DEMO_MEMORIES))
        model = _call(base, "/v1/models")["data"][0]["id"]
        seeded = [{**ask(base, q, args.max_tokens, model), "expect": k} for q, k in QUESTIONS]
        for text in CHIT_CHAT + STATEMENTS:
            ask(base, text, args.max_tokens, model)
        wait_formed(base)
        time.sleep(1.0)  # the scheduler's refresh after the formed memories' change events
        formed = [{**ask(base, q, args.max_tokens, model), "expect": k} for q, k in FORMED_QUESTIONS]
        sources = block_sources(base)
        listing = _call(base, f"/v1/memories?user_id={USER}&page_size=100&include_superseded=true")["data"]
    for row in seeded + formed:
        row["answered"] = row["expect"] in row["answer"].lower()
    result = {
        "benchmark": "demo_memory",
        "git_sha": git_sha(),
        "loadavg": os.getloadavg(),
        "model": model,
        "num_seeded_answered": sum(r["answered"] for r in seeded),
        "num_seeded_questions": len(seeded),
        "dog_answered_miso": seeded[0]["answered"],
        "num_formed_answered": sum(r["answered"] for r in formed),
        "num_formed_questions": len(formed),
        "seeded": seeded,
        "formed": formed,
        "memories_after": [
            {k: m[k] for k in ("text", "source", "superseded_by", "valid_to")} for m in listing
        ],
        **sources,
    }
    print(f"{'question':<46} {'expect':<8} {'ok':<3} answer")
    for row in seeded + formed:
        answer = " ".join(row["answer"].split())[:70]
        print(f"{row['question']:<46} {row['expect']:<8} {'yes' if row['answered'] else 'no':<3} {answer}")
    print(
        f"seeded {result['num_seeded_answered']}/{len(seeded)}, formed {result['num_formed_answered']}/"
        f"{len(formed)}, block share from assistant/chit-chat {sources['share_of_block_from_assistant_or_chit_chat']}"
    )
    write_outputs(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

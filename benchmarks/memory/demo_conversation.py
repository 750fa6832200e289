"""A held-out conversation for the memory block's presentation (issue 45 item 5): does the served model answer
from what the user said earlier, and does it answer in its own voice rather than echo the user's words?

Run: python -m benchmarks.memory.demo_conversation --out benchmarks/results/cpu/demo_conversation.json [--model DIR]
Spawns `kvmem serve --no-auth` on loopback (turns logged and formed by the default rules extractor), has a
user state six facts in chat turns (one compound: "I live in Porto with my husband Tiago."), waits until they
are formed and all in the user's KV block, asks six questions at temperature 0, then says "We moved to Braga
last month." and asks where the user lives and the husband's name again (a move must not retire the
husband's name). Per answer: right (contains the expected word), echo (shares a run of five or more words
with one of the user's own statements) and user voice (states the user's fact in the first person: "My
husband is", "I live in"). The conversation was written for this script and is used nowhere else. Prints a
table; the last stdout line is one JSON document (git sha, load average, model, every answer).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from benchmarks.common import git_sha, write_outputs
from benchmarks.load.http_client import spawned_server, wait_for_block

USER = "heldout"
STATEMENTS = (
    "I live in Porto with my husband Tiago.",
    "I work as a pharmacist.",
    "My daughter is called Lia.",
    "I have a cat named Biscuit.",
    "I'm allergic to shellfish.",
    "My favourite sport is volleyball.",
)
QUESTIONS = (  # (question, a word the answer must contain)
    ("What is my husband's name?", "tiago"),
    ("Where do I live?", "porto"),
    ("What do I do for a living?", "pharmacist"),
    ("What is my daughter called?", "lia"),
    ("What is my cat's name?", "biscuit"),
    ("What am I allergic to?", "shellfish"),
)
MOVE = "We moved to Braga last month."
AFTER_MOVE = (("Where do I live now?", "braga"), ("What is my husband's name?", "tiago"))
_WORDS = re.compile(r"[a-z0-9']+")
USER_VOICE = re.compile(
    r"\b(?:my (?:husband|daughter|cat|job|favourite)|I live|I work|I'm (?:a pharmacist|allergic)|I am "
    r"(?:a pharmacist|allergic)|I have a cat)\b",
    re.I,
)


def _call(base: str, path: str, body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"{base}{path}", data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as r:  # noqa: S310 - loopback only
        return json.loads(r.read())


def chat(base: str, text: str, max_tokens: int, model: str) -> str:
    body = {
        "model": model,
        "user": USER,
        "temperature": 0,
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": text}],
    }
    return _call(base, "/v1/chat/completions", body)["choices"][0]["message"]["content"]


def echo_run(answer: str, said: tuple[str, ...]) -> int:
    """The longest run of words the answer shares with one of the user's statements."""
    words = _WORDS.findall(answer.lower())
    best = 0
    for statement in said:
        own = _WORDS.findall(statement.lower())
        for i in range(len(words)):
            for j in range(len(own)):
                k = 0
                while i + k < len(words) and j + k < len(own) and words[i + k] == own[j + k]:
                    k += 1
                best = max(best, k)
    return best


def score(question: str, expect: str, answer: str, said: tuple[str, ...]) -> dict:
    run = echo_run(answer, said)
    print(f"{question!r} -> {answer!r}", file=sys.stderr, flush=True)  # progress, kept if a later step fails
    return {
        "question": question,
        "expect": expect,
        "answer": answer,
        "right": expect in answer.lower(),
        "echo_run": run,
        "echo": run >= 5,
        "user_voice": bool(USER_VOICE.search(answer)),
    }


def wait_formed_in_block(base: str, timeout_s: float = 300) -> list[str]:
    """Wait until formation is idle and the user's block holds every current memory; their texts."""
    deadline = time.monotonic() + timeout_s
    while _call(base, f"/v1/memories/formation?user_id={USER}")["pending"]:
        if time.monotonic() > deadline:
            raise RuntimeError(f"formation still pending after {timeout_s} s")
        time.sleep(0.25)
    time.sleep(1.0)  # the scheduler's refresh after the formed memories' change events
    memories = _call(base, f"/v1/memories?user_id={USER}&page_size=100")["data"]
    wait_for_block(base, USER, expected=len(memories), timeout_s=timeout_s)
    return [m["text"] for m in memories]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model dir or id (default: the server's default)")
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    loadavg = os.getloadavg()
    with (
        tempfile.TemporaryDirectory() as tmp,
        spawned_server(
            backend="transformers", model=args.model, block_budget=2048, top_k=8, data_dir=f"{tmp}/data",
            store_turns=True,
        ) as base,
    ):  # fmt: skip
        model = _call(base, "/v1/models")["data"][0]["id"]
        for text in STATEMENTS:
            chat(base, text, args.max_tokens, model)
        formed = wait_formed_in_block(base)
        rows = [score(q, k, chat(base, q, args.max_tokens, model), STATEMENTS) for q, k in QUESTIONS]
        chat(base, MOVE, args.max_tokens, model)
        moved = wait_formed_in_block(base)
        said = (*STATEMENTS, MOVE)
        rows += [score(q, k, chat(base, q, args.max_tokens, model), said) for q, k in AFTER_MOVE]
        block = _call(base, f"/v1/memories/plan?user_id={USER}")["block"]
    result = {
        "benchmark": "demo_conversation",
        "git_sha": git_sha(),
        "loadavg": loadavg,
        "model": model,
        "num_questions": len(rows),
        "num_right": sum(r["right"] for r in rows),
        "num_echo": sum(r["echo"] for r in rows),
        "num_user_voice": sum(r["user_voice"] for r in rows),
        "husband_named_after_move": rows[-1]["right"],
        "memories_formed": formed,
        "memories_after_move": moved,
        "block_memory_ids": block["memory_ids"] if block else [],
        "answers": rows,
    }
    print(f"{'question':<30} {'expect':<10} {'ok':<3} {'echo':<4} {'voice':<5} answer")
    for r in rows:
        answer = " ".join(r["answer"].split())[:60]
        print(
            f"{r['question']:<30} {r['expect']:<10} {'yes' if r['right'] else 'no':<3} "
            f"{r['echo_run']:<4} {'I' if r['user_voice'] else '-':<5} {answer}"
        )
    print(
        f"right {result['num_right']}/{len(rows)}, echoes {result['num_echo']}, user voice {result['num_user_voice']}"
    )
    write_outputs(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Conversation KV reuse: TTFT per turn of a 20-turn conversation over a ~1.5k-token block, with and without it.

Two `kvmem serve` processes (the transformers backend) on 127.0.0.1, one with live sessions' KV caches
(`--session-kv-mb`, the default) and one with `--session-kv-mb 0`, each with the same user and memories: most
in the user's KV block, the rest retrieved as text each turn. The same conversation (X-Session-Id) is sent to
both, turn by turn, alternating which server goes first, so the machine's load hits both arms alike; each
turn's messages are the whole history so far, as an OpenAI client sends them, with the replies the server
gave (greedy: both servers must give the same ones, and the result says whether they did). TTFT is the
client's, to the first content chunk through the official openai client; `prefill_s` is the server's own
inject + prefill + first token (its prefill histogram). Target: turn 20 within 1.5x of turn 1 with reuse.

    python -m benchmarks.ttft.session_ttft --out benchmarks/results/cpu/session_ttft.json
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

from benchmarks.common import env_info, median, print_table, write_outputs
from benchmarks.load.http_client import _get, _post, memory_texts, seed, server_totals, spawned_server

QUESTIONS = [
    "I just got back from {w}. What do you think I should do this weekend?",
    "Can you remind me what I told you about {w}?",
    "My sister asked about {w}. How would you answer her?",
    "I am worried about {w} and the budget. Any advice?",
    "What is one thing about {w} I should not forget next month?",
]
_TOPICS = (
    "the kitchen renovation|my violin lessons|the marathon|Kyoto|sourdough|the mortgage|my garden".split("|")
)
ARMS = ("reuse", "no_reuse")


def question(turn: int) -> str:
    return QUESTIONS[turn % len(QUESTIONS)].format(w=_TOPICS[turn % len(_TOPICS)])


@dataclass
class Turn:
    turn: int
    arm: str
    ttft_s: float
    prefill_s: float | None  # the server's prefill histogram's increase over this turn
    prompt_tokens: int
    cached_tokens: int
    text_memories: int  # retrieved as text this turn (the rest of `memory.used` came from the block)
    reply: str
    loadavg_1m: float


def wait_for_block(base: str, user: str, quiet_s: float = 5.0, timeout_s: float = 1200) -> dict:
    """Poll the plan route until the user's block is published and has not changed for `quiet_s`. Call it on a
    server started over memories seeded before it started: its first refresh sees them all, so its first block
    is the one to measure (while memories are added, the block grows a build at a time)."""
    _post(f"{base}/v1/memories/plan/prewarm", {"user_id": user})  # a plan read never builds one
    deadline, last, since = time.monotonic() + timeout_s, None, time.monotonic()
    while time.monotonic() < deadline:
        plan = _get(f"{base}/v1/memories/plan?user_id={user}")
        block = plan["block"] or {"tier": "none", "memory_ids": []}  # null when there is none
        key = (block["tier"], tuple(block["memory_ids"]), plan["scheduler"]["queue_depth"])
        if key != last:
            last, since = key, time.monotonic()
        elif key[0] != "none" and key[2] == 0 and time.monotonic() - since >= quiet_s:
            return plan
        time.sleep(0.5)
    raise RuntimeError(f"no settled block for {user} in {timeout_s} s")


def one_turn(client: Any, model: str, user: str, session: str, messages: list[dict], max_tokens: int) -> dict:
    start = time.perf_counter()
    ttft, usage, used, parts = None, None, [], []
    stream = client.chat.completions.create(
        model=model,
        user=user,
        temperature=0,
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
        messages=messages,
        extra_headers={"X-Session-Id": session},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            if ttft is None:
                ttft = time.perf_counter() - start
            parts.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
        memory = (chunk.model_extra or {}).get("memory")
        if memory:
            used = memory.get("used", [])
    return {
        "ttft_s": ttft if ttft is not None else time.perf_counter() - start,
        "prompt_tokens": usage.prompt_tokens,
        "cached_tokens": usage.prompt_tokens_details.cached_tokens,
        "text_memories": sum(1 for m in used if m["tier"] == "text"),
        "reply": "".join(parts),
    }


def converse(bases: dict[str, str], user: str, turns: int, max_tokens: int, session: str) -> list[Turn]:
    """One conversation sent to every arm's server, turn by turn; each arm keeps its own history. Its system
    message names the conversation, so no conversation's first turn starts from another's pages in the
    server's automatic prefix cache (the warm-up's): turn 1 is served from the block alone."""
    from openai import OpenAI

    models = {a: _get(f"{b}/v1/models")["data"][0]["id"] for a, b in bases.items()}
    clients = {
        a: OpenAI(base_url=f"{b}/v1", api_key="unused", max_retries=0, timeout=600) for a, b in bases.items()
    }
    history = {
        a: [{"role": "system", "content": f"{session}: you are talking to a returning user. Be brief."}]
        for a in bases
    }
    out: list[Turn] = []
    for k in range(turns):
        order = list(bases) if k % 2 == 0 else list(reversed(bases))
        for arm in order:
            history[arm].append({"role": "user", "content": question(k)})
            before = server_totals(bases[arm]).get("prefill")
            got = one_turn(clients[arm], models[arm], user, session, history[arm], max_tokens)
            after = server_totals(bases[arm]).get("prefill")
            prefill = after[0] - before[0] if before and after and after[1] == before[1] + 1 else None
            history[arm].append({"role": "assistant", "content": got["reply"]})
            out.append(
                Turn(
                    k + 1,
                    arm,
                    got["ttft_s"],
                    prefill,
                    got["prompt_tokens"],
                    got["cached_tokens"],
                    got["text_memories"],
                    got["reply"],
                    os.getloadavg()[0],
                )
            )
            print(
                f"# turn {k + 1:2d} {arm:8s} ttft {got['ttft_s']:.3f}s prompt {got['prompt_tokens']} "
                f"cached {got['cached_tokens']}",
                file=sys.stderr,
            )
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.ttft.session_ttft", description=__doc__.splitlines()[0]
    )
    p.add_argument("--model", default=None)
    p.add_argument("--turns", type=int, default=20)
    p.add_argument("--repeats", type=int, default=2, help="conversations (fresh sessions) per arm; medians")
    p.add_argument("--memories", type=int, default=60, help="memories of 28 words (60: ~2.2k tokens)")
    p.add_argument("--block-token-budget", type=int, default=1536, help="block tokens (the rest: text)")
    p.add_argument("--top-k", type=int, default=8, help="memories retrieved per turn")
    p.add_argument("--max-tokens", type=int, default=32, help="reply tokens per turn")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    env = {**env_info("cpu"), "loadavg_start": list(os.getloadavg())}
    user, texts = "session-user", memory_texts(args.memories, 28)
    turns: list[Turn] = []
    plans: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        kw: dict[str, Any] = dict(
            backend="transformers", model=args.model, block_budget=args.block_token_budget, top_k=args.top_k
        )
        dirs = {"reuse": os.path.join(tmp, "reuse"), "no_reuse": os.path.join(tmp, "off")}
        extra = {"reuse": (), "no_reuse": ("--session-kv-mb", "0")}
        for data_dir in dirs.values():  # memories first, through the API; the block is built below
            with spawned_server(data_dir=data_dir, **{**kw, "block_budget": 0}) as base:
                seed(base, user, texts)
        with (
            spawned_server(data_dir=dirs["reuse"], extra=extra["reuse"], **kw) as reuse,
            spawned_server(data_dir=dirs["no_reuse"], extra=extra["no_reuse"], **kw) as off,
        ):
            bases = {"reuse": reuse, "no_reuse": off}
            for arm, base in bases.items():
                plans[arm] = wait_for_block(base, user)
                print(f"# {arm}: block of {plans[arm]['block']['tokens']} tokens", file=sys.stderr)
            converse(bases, user, 1, args.max_tokens, "warm-up")
            for r in range(args.repeats):
                turns += converse(bases, user, args.turns, args.max_tokens, f"conversation-{r}")
            end_plans = {arm: _get(f"{b}/v1/memories/plan?user_id={user}") for arm, b in bases.items()}
    per_turn = []
    for k in range(1, args.turns + 1):
        row: dict[str, Any] = {"turn": k}
        for arm in ARMS:
            mine = [t for t in turns if t.turn == k and t.arm == arm]
            row[f"{arm}_ttft_s"] = median([t.ttft_s for t in mine])
            prefills = [t.prefill_s for t in mine if t.prefill_s is not None]
            row[f"{arm}_prefill_s"] = median(prefills) if prefills else None
            row[f"{arm}_prompt_tokens"] = mine[0].prompt_tokens
            row[f"{arm}_cached_tokens"] = mine[0].cached_tokens
        row["text_memories"] = [t.text_memories for t in turns if t.turn == k and t.arm == "reuse"][0]
        per_turn.append(row)
    replies = {arm: [t.reply for t in turns if t.arm == arm] for arm in ARMS}
    first, last = per_turn[0], per_turn[-1]
    summary = {
        arm: {
            "turn1_ttft_s": first[f"{arm}_ttft_s"],
            f"turn{args.turns}_ttft_s": last[f"{arm}_ttft_s"],
            "last_over_first": last[f"{arm}_ttft_s"] / first[f"{arm}_ttft_s"],
            "last_over_first_prefill": (
                last[f"{arm}_prefill_s"] / first[f"{arm}_prefill_s"]
                if last[f"{arm}_prefill_s"] and first[f"{arm}_prefill_s"]
                else None
            ),
        }
        for arm in ARMS
    }
    summary["target_last_within_1_5x_of_first"] = summary["reuse"]["last_over_first"] <= 1.5
    summary["replies_identical"] = replies["reuse"] == replies["no_reuse"]
    summary["block_tokens"] = plans["reuse"]["block"]["tokens"]
    summary["block_unchanged"] = all(
        (end_plans[a]["block"] or {}).get("memory_ids") == plans[a]["block"]["memory_ids"] for a in ARMS
    )
    print_table(
        [
            "Turn",
            "Prompt tok",
            "Cached (reuse)",
            "TTFT reuse (s)",
            "TTFT no reuse (s)",
            "Prefill reuse (s)",
            "Prefill no reuse (s)",
            "Text mems",
        ],
        [
            [
                r["turn"],
                r["reuse_prompt_tokens"],
                r["reuse_cached_tokens"],
                r["reuse_ttft_s"],
                r["no_reuse_ttft_s"],
                r["reuse_prefill_s"],
                r["no_reuse_prefill_s"],
                r["text_memories"],
            ]
            for r in per_turn
        ],
    )
    print(f"# summary: {summary}", file=sys.stderr)
    env.update(
        loadavg_end=list(os.getloadavg()),
        turns=args.turns,
        repeats=args.repeats,
        memories=args.memories,
        block_token_budget=args.block_token_budget,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        server="spawned kvmem serve, transformers backend, 127.0.0.1",
    )
    result = {"env": env, "per_turn": per_turn, "summary": summary, "turns": [asdict(t) for t in turns]}
    write_outputs(result, args.out)
    return result


if __name__ == "__main__":
    main()

"""The memory block's system prompt against the order of its memories (issue 45 item 5): the demo's and the
held-out conversation's questions asked of the model directly, greedy, over PromptLayout's prompt, for several
orders of each block (the server orders a block by its scores, so one HTTP run sees one order).

Run: python -m benchmarks.memory.block_wording --out benchmarks/results/cpu/block_wording.json
     [--model DIR] [--orders 6] [--system "..." ...] [--echo 0 1 2]

`--echo K`: the question's top K hits of the store's own search (hybrid, the default embedder, over the same
memories) repeated in the last user message's retrieved-memories slot although the block holds them (the server
leaves hits the block covers out of that slot: serving/chat/prepare.py); one row per prompt and K.

Right: the expected word starts a word of the answer; user voice: the user's fact stated in the first person.
Default prompts: the layout's DEFAULT_SYSTEM_PROMPT with and without the clause e512a6c tried. The last stdout line is the JSON.
"""

from __future__ import annotations

import argparse
import random
import re
import time
from pathlib import Path

from benchmarks.common import env_info, write_outputs
from benchmarks.memory import demo_conversation, demo_memory
from kvmem.formation.rules import RuleExtractor
from kvmem.formation.types import TurnInput
from kvmem.kv.layout import DEFAULT_SYSTEM_PROMPT, PromptLayout
from serving.background.startup import DEMO_MEMORIES

DEMO_MODEL = Path.home() / ".cache" / "kvmem" / "models" / "Qwen2.5-Coder-0.5B-Instruct"
# the default system prompt with the clause e512a6c tried and a later commit took out (docs/benchmarks.md)
SELF_QUESTIONS_PROMPT = (
    "You are a helpful assistant with long-term memory. Use what you remember about the user when it helps;"
    " when the user asks about themselves, answer from the facts below."
)


# the demo user's facts in the first person ("My dog is Miso.", "I live in Lisbon."); the held-out
# conversation's: demo_conversation.USER_VOICE
DEMO_USER_VOICE = re.compile(
    r"\b(?:my (?:dog|name|favourite|job|work)|I live|I work|I study|I(?:'m| am) (?:a marine|allergic|Dana)|"
    r"I have a (?:golden|dog))\b",
    re.I,
)


def held_out_memories() -> list[str]:
    """The held-out conversation's statements as the rules form them: one fact a memory, as sentences."""
    turns = [
        TurnInput(f"t{i}", "user", text, "2026-11-30T09:00:00.000000Z", "s")
        for i, text in enumerate(demo_conversation.STATEMENTS)
    ]
    return [f.text + "." for f in RuleExtractor().extract(turns)]


def run(model_dir: str, prompts: list[str], orders: int, max_tokens: int, echoes=(0,)) -> list[dict]:
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvmem.text import MemoryStore
    from kvmem.text.search.embedders import default_embedder

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    sets = (
        ("demo", list(DEMO_MEMORIES), demo_memory.QUESTIONS, DEMO_USER_VOICE),
        ("held_out", held_out_memories(), demo_conversation.QUESTIONS, demo_conversation.USER_VOICE),
    )
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        store = None
        if max(echoes) > 0:  # the store's own search over each set's memories
            store = MemoryStore(Path(tmp) / "m.db", embedder=default_embedder())
            for name, memories, *_ in sets:
                store.add(name, texts=memories)
        try:
            for prompt in prompts:
                for echo in echoes:
                    results.append(_one(model, tokenizer, store, sets, prompt, echo, orders, max_tokens))
        finally:
            if store is not None:
                store.close()
    return results


def _one(model, tokenizer, store, sets, prompt: str, echo: int, orders: int, max_tokens: int) -> dict:
    import torch

    layout = PromptLayout(tokenizer, system_prompt=prompt)
    answers = []
    started = time.perf_counter()
    for order in range(orders):
        for name, memories, questions, voice in sets:
            block = list(memories)
            if order:
                random.Random(order).shuffle(block)
            for question, expect in questions:
                hits = store.search(name, question, top_k=8)[:echo] if echo else []
                repeated = [h.memory.text for h in hits]
                ids = layout.prompt(block, repeated, [{"role": "user", "content": question}]).ids
                with torch.inference_mode():
                    out = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False)
                answer = tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)
                answers.append(
                    {
                        "order": order,
                        "set": name,
                        "question": question,
                        "repeated": repeated,
                        "answer": answer,
                        "right": bool(re.search(rf"\b{re.escape(expect)}", answer.lower())),
                        "user_voice": bool(voice.search(answer)),
                    }
                )
    row = {"system_prompt": prompt, "echo": echo, "seconds": round(time.perf_counter() - started, 1)}
    for name, *_ in sets:
        mine = [a for a in answers if a["set"] == name]
        row[name] = {
            "questions": len(mine),
            "right": sum(a["right"] for a in mine),
            "user_voice": sum(a["user_voice"] for a in mine),
        }
    row["answers"] = answers
    print(f"{prompt[-60:]!r}, echo {echo}: demo {row['demo']}, held out {row['held_out']}", flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEMO_MODEL), help="model dir (default: the demo model)")
    parser.add_argument("--system", action="append", help="a system prompt to compare (repeatable)")
    parser.add_argument("--orders", type=int, default=6, help="orders of each block (the first as listed)")
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument(
        "--echo", type=int, nargs="+", default=[0], help="top search hits repeated (module doc)"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.orders < 1 or min(args.echo) < 0:
        parser.error("--orders must be at least 1 and --echo at least 0")
    import torch

    torch.set_num_threads(args.threads)
    prompts = args.system or [SELF_QUESTIONS_PROMPT, DEFAULT_SYSTEM_PROMPT]
    result = {
        "benchmark": "block_wording",
        "env": env_info(),
        "model": Path(args.model).name,
        "orders": args.orders,
        "max_tokens": args.max_tokens,
        "prompts": run(args.model, prompts, args.orders, args.max_tokens, args.echo),
    }
    write_outputs(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

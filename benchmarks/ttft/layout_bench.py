"""Prompt layout time against conversation length: the per-prefix layout (one chat-template render per prefix,
quadratic) against the message-local one (each message rendered after a stand-in of its predecessor's role,
cached), same ids.

For each length (messages after the system message, alternating user/assistant, ending with a user message,
8 block memories, 3 retrieved): `per_prefix` lays it out on a fresh layout; `local_cold` on a fresh layout
(empty segment cache: the worst case, a long-lived layout also keeps the per-role stand-ins); `local_turn` on
a layout that laid out the previous turn (two messages fewer) just before, as a live session's next turn
(from 3 messages). Renders and the messages they rendered are counted per call (the template's system
opening, rendered once per layout, is done before timing). The ids of every arm must be the per-prefix ids,
else the run is refused. Arms alternate within a rep so they see the same machine load; shorter lengths get
more reps.

    python -m benchmarks.ttft.layout_bench --out benchmarks/results/cpu/layout_bench.json
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable

from benchmarks.common import OthersCpu, env_info, median, p90, print_table, write_outputs
from kvmem.kv import PromptLayout

WORDS = "the a I you my sister lives in Lisbon likes tea and peanuts work on Monday with the team".split()


class PerPrefixLayout(PromptLayout):
    """The layout before it went linear: every prefix of the conversation rendered."""

    def _message_segments(self, system, conversation, rendered, done):
        return self._prefix_segments(system, conversation, rendered, done)


def conversation(rng: random.Random, num_messages: int) -> list[dict]:
    roles = ["user", "assistant"] if num_messages % 2 else ["assistant", "user"]
    return [
        {"role": roles[k % 2], "content": " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 40)))}
        for k in range(num_messages)
    ]


def counted(layout: PromptLayout) -> list[int]:
    """Count `layout`'s renders: the list gets each render's number of messages."""
    calls: list[int] = []
    render = layout._render

    def wrapped(messages, generation_prompt):
        calls.append(len(messages))
        return render(messages, generation_prompt)

    layout._render = wrapped
    return calls


def run_arm(make: Callable[[], tuple[PromptLayout, Callable[[], object]]]) -> tuple[float, int, int, object]:
    """(seconds, renders, messages rendered, result) of one timed call on a freshly prepared layout."""
    layout, call = make()
    calls = counted(layout)
    start = time.perf_counter()
    result = call()
    elapsed = time.perf_counter() - start
    return elapsed, len(calls), sum(calls), result


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[11, 81, 321])
    p.add_argument(
        "--reps",
        type=int,
        default=5,
        help="at the longest length; shorter ones get more, to the same time (max 60)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    from transformers import AutoTokenizer

    from kvmem.models import provision

    tokenizer = AutoTokenizer.from_pretrained(str(provision()))
    env = env_info("cpu")
    rng = random.Random(args.seed)
    blocks = [" ".join(rng.choice(WORDS) for _ in range(10)) for _ in range(8)]
    retrieved = [" ".join(rng.choice(WORDS) for _ in range(10)) for _ in range(3)]

    def fresh(cls):
        layout = cls(tokenizer)
        assert layout.system_open  # rendered once per layout: not what is measured
        return layout

    def arms(messages: list[dict]) -> dict[str, Callable]:
        def per_prefix():
            layout = fresh(PerPrefixLayout)
            return layout, lambda: layout.prompt(blocks, retrieved, messages)

        def local_cold():
            layout = fresh(PromptLayout)
            return layout, lambda: layout.prompt(blocks, retrieved, messages)

        def local_turn():
            layout = fresh(PromptLayout)
            layout.prompt(blocks, retrieved, messages[:-2])  # the previous turn
            return layout, lambda: layout.prompt(blocks, retrieved, messages)

        made = {"per_prefix": per_prefix, "local_cold": local_cold, "local_turn": local_turn}
        return made if len(messages) > 2 else {k: v for k, v in made.items() if k != "local_turn"}

    for make in arms(conversation(rng, 11)).values():  # warm-up: template compiled, tokenizer paths hot
        run_arm(make)

    rows, results = [], []
    meter = OthersCpu()
    meter.start()
    for n in args.lengths:
        messages = conversation(rng, n)
        times: dict[str, list[float]] = {}
        counts: dict[str, tuple[int, int]] = {}
        expected = None
        num_reps = min(60, max(args.reps, args.reps * max(args.lengths) // n))
        for _ in range(num_reps):
            for name, make in arms(messages).items():
                elapsed, renders, rendered_messages, prompt = run_arm(make)
                expected = prompt if expected is None else expected
                if prompt != expected:
                    sys.exit(f"{name} laid out {n} messages differently from per_prefix: refusing to report")
                times.setdefault(name, []).append(elapsed)
                counts[name] = (renders, rendered_messages)
        base = median(times["per_prefix"])
        for name, ts in times.items():
            renders, rendered_messages = counts[name]
            record = {
                "num_messages": n,
                "reps": num_reps,
                "arm": name,
                "renders": renders,
                "messages_rendered": rendered_messages,
                "median_ms": 1000 * median(ts),
                "p90_ms": 1000 * p90(ts),
                "speedup": base / median(ts),
                "prompt_tokens": len(expected.ids),
            }
            results.append(record)
            rows.append(
                [
                    n,
                    name,
                    renders,
                    rendered_messages,
                    record["median_ms"],
                    record["p90_ms"],
                    record["speedup"],
                ]
            )
    others = meter.share()
    print_table(["messages", "arm", "renders", "msgs rendered", "median ms", "p90 ms", "x per_prefix"], rows)
    result = {
        "bench": "layout_bench",
        "env": env,
        "seed": args.seed,
        "num_block_memories": len(blocks),
        "num_retrieved": len(retrieved),
        "others_cpu_share": others,
        "results": results,
    }
    write_outputs(result, args.out)
    return result


if __name__ == "__main__":
    main()

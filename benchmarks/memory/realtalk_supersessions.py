"""What the rules retire on real chat: every REALTALK speaker's turns formed and consolidated in order, as the
background worker does for one user, and every supersession listed (issue 45 item 3).

Run: python -m benchmarks.memory.realtalk_supersessions --out benchmarks/results/cpu/realtalk_supersessions.json

REALTALK's chats (benchmarks/memory/conversations.py fetches them; not committed) are two people talking over
weeks, mostly about their day: few changes of state and many statements that change nothing. There are no
labels for supersession, so this counts and lists; a reader judges. It is the check that kept a lexical link
between a change and the memory it names out of the rules (docs/benchmarks.md, "Fifth sealed set"): scored on
the sealed sets it caught more changes, here it retired hundreds of unrelated memories.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Sequence
from pathlib import Path

from benchmarks.common import env_info, write_outputs
from benchmarks.memory.conversations import load_conversation
from benchmarks.memory.formation_public import DEFAULT_DATA_DIR
from kvmem.formation.consolidate import ExistingMemory, consolidate_batch
from kvmem.formation.rules import RuleExtractor
from kvmem.formation.types import TurnInput


def supersessions(turns: Sequence[tuple[str, str]]) -> tuple[int, list[dict]]:
    """One user's (text, chat_time) turns formed by the rules and consolidated in order against every current
    memory: how many facts were formed, and each supersession (the new fact, the memory it retired, their
    slots)."""
    extractor = RuleExtractor()
    current: dict[str, ExistingMemory] = {}
    retired: list[dict] = []
    formed = 0
    for i, (text, when) in enumerate(turns):
        facts = extractor.extract([TurnInput(f"t{i}", "user", text, when, "s")])
        formed += len(facts)
        result = consolidate_batch(facts, list(current.values()), said_at=[when] * len(facts))
        for s in result.supersessions:
            old = current.get(s.old_id)
            if old is not None:
                new = facts[s.new_index]
                retired.append(
                    {"fact": new.text, "fact_slot": new.slot, "retired": old.text, "retired_slot": old.slot}
                )
        for k, (fact, decision) in enumerate(zip(facts, result.decisions, strict=True)):
            if decision.kind not in ("duplicate", "outdated"):
                current[f"{i}:{k}"] = ExistingMemory(f"{i}:{k}", fact.text, fact.slot, fact.value, when, when)
        for s in result.supersessions:
            current.pop(s.old_id, None)
    return formed, retired


def speakers_turns(paths: Iterable[Path]) -> list[tuple[str, list[tuple[str, str]]]]:
    """(chat/speaker, that speaker's turns in order) for every chat file."""
    out = []
    for path in sorted(paths):
        conversation = load_conversation(path)
        turns = [t for session in conversation.sessions for t in session.turns]
        for speaker in sorted({t.speaker for t in turns}):
            mine = [(t.text, t.chat_time) for t in turns if t.speaker == speaker]
            out.append((f"{conversation.name}/{speaker}", mine))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR, help="REALTALK's Chat_*.json")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    paths = list(args.data_dir.glob("Chat_*.json"))
    if not paths:
        parser.error(f"no Chat_*.json in {args.data_dir}: python -m benchmarks.memory.conversations first")
    rows = []
    for user, turns in speakers_turns(paths):
        formed, retired = supersessions(turns)
        rows.append({"user": user, "turns": len(turns), "facts": formed, "supersessions": retired})
    result = {
        "benchmark": "realtalk_supersessions",
        "env": env_info(),
        "num_users": len(rows),
        "num_turns": sum(r["turns"] for r in rows),
        "num_facts": sum(r["facts"] for r in rows),
        "num_supersessions": sum(len(r["supersessions"]) for r in rows),
        "users": rows,
    }
    print(
        f"{result['num_users']} users, {result['num_turns']} turns, {result['num_facts']} facts, "
        f"{result['num_supersessions']} supersessions",
        flush=True,
    )
    write_outputs(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What the rules retire on real chat: every REALTALK speaker's turns formed and consolidated in order, every
supersession listed (issue 45 item 3).

Run: python -m benchmarks.memory.realtalk_supersessions \
    --out benchmarks/results/cpu/realtalk_supersessions.json

Close to the background worker for one user, not the same: every current memory is a candidate (the worker
takes those of the facts' slots and the nearest by embedding) and no embedding similarity is used. REALTALK
has no supersession labels, so this counts and lists; a reader judges (docs/benchmarks.md, "Fifth sealed
set").
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Sequence
from pathlib import Path

from benchmarks.common import env_info, write_outputs
from benchmarks.memory.conversations import SPLITS, load_conversation
from benchmarks.memory.formation_public import DEFAULT_DATA_DIR
from benchmarks.memory.state_changes_heldout import ChangeReader, form_in_order
from kvmem.formation.change_head import load_change_head
from kvmem.formation.pair_encoder import load_pair_encoder
from kvmem.formation.rules import RuleExtractor
from kvmem.formation.types import TurnInput


def supersessions(
    turns: Sequence[tuple[str, str]], reader: ChangeReader | None = None
) -> tuple[int, list[dict]]:
    """One user's (text, chat_time) turns formed by the rules and consolidated in order
    (state_changes_heldout.form_in_order): how many facts were formed, and each supersession (the new fact,
    the memory it retired, their slots)."""
    inputs = [TurnInput(f"t{i}", "user", text, when, "s") for i, (text, when) in enumerate(turns)]
    formed, retired = 0, []
    for facts, gone in form_in_order(inputs, RuleExtractor(), reader):
        formed += len(facts)
        retired += [
            {
                "fact": r.by.text,
                "fact_slot": r.by.slot,
                "retired": r.memory.text,
                "retired_slot": r.memory.slot,
            }
            for r in gone
        ]
    return formed, retired


# the chats whose turns train the change head as real-chat negatives (benchmarks/memory/train_change_head.py):
# REALTALK's tune split (benchmarks.memory.conversations.SPLITS); `--chats report` reports on the other five,
# text the head never saw
NEGATIVE_CHATS = SPLITS["tune"]


def chat_paths(data_dir: Path, prefixes: Sequence[str] | None = None) -> list[Path]:
    """REALTALK's Chat_*.json in `data_dir`, those named by `prefixes` only where given; an error naming the
    directory where none is there."""
    paths = sorted(data_dir.glob("Chat_*.json"))
    if prefixes is not None:
        paths = [p for p in paths if p.name.startswith(tuple(prefixes))]
    if not paths:
        raise FileNotFoundError(
            f"no REALTALK Chat_*.json in {data_dir}: python -m benchmarks.memory.conversations first"
        )
    return paths


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
    parser.add_argument(
        "--change-head",
        default="shipped",
        help="the change head the rules' decisions read, as the server's worker does: 'shipped', 'none', or a "
        "head file",
    )
    parser.add_argument(
        "--pair-encoder",
        default="shipped",
        help="with the change head: the pair encoder its reading adds, as the worker's: 'shipped', 'none', or "
        "an encoder file",
    )
    parser.add_argument(
        "--chats",
        choices=("all", "report"),
        default="all",
        help="all ten chats, or the report split's five only (the tune split's train the shipped head's real-chat "
        "negatives)",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    head = (
        None
        if args.change_head == "none"
        else load_change_head(None if args.change_head == "shipped" else args.change_head)
    )
    encoder = None
    if args.pair_encoder != "none":
        encoder = load_pair_encoder(None if args.pair_encoder == "shipped" else args.pair_encoder).load()
    reader = ChangeReader(head, encoder=encoder) if head is not None else None
    try:
        paths = chat_paths(args.data_dir)
    except FileNotFoundError as error:
        parser.error(str(error))
    if args.chats == "report":
        paths = [p for p in paths if not p.name.startswith(NEGATIVE_CHATS)]
    rows = []
    for user, turns in speakers_turns(paths):
        formed, retired = supersessions(turns, reader)
        rows.append({"user": user, "turns": len(turns), "facts": formed, "supersessions": retired})
    result = {
        "benchmark": "realtalk_supersessions",
        "env": env_info(),
        "change_head": args.change_head,
        "pair_encoder": args.pair_encoder,
        "chats": args.chats,
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

"""A hand-labelled memory-formation sample of REALTALK: which facts each sampled turn states.

The labels (benchmarks/data/formation_labels/realtalk_sample.json) name turns by (chat file stem, dia_id)
and hold our own short first-person fact statements; REALTALK has no licence file, so the turns' text is
not committed and is read here from a local copy of its data/Chat_*.json (`python -m benchmarks.memory.conversations`
puts one in ~/.cache/kvmem/datasets/realtalk). The sampled turns are the ones `sample_turn_ids` draws with
SEED, so the sample can be drawn again from the data and checked. Knows nothing of the store or the extractor.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path

from benchmarks.memory.conversations import SPLITS, Conversation, load_conversation

LABELS_PATH = Path(__file__).resolve().parents[1] / "data" / "formation_labels" / "realtalk_sample.json"
DEFAULT_DATA_DIR = Path.home() / ".cache/kvmem/datasets/realtalk"
FACT_KINDS = ("fact", "preference", "plan", "relation", "event")

# The draw the labels were made on: per chat, SESSIONS_PER_CHAT sessions among those with at least
# MIN_SESSION_TURNS text turns, then TURNS_PER_SESSION turns of each, uniformly, with random.Random(f"{SEED}:{chat}").
SEED = 20240611
SESSIONS_PER_CHAT = 3
TURNS_PER_SESSION = 5
MIN_SESSION_TURNS = 10


@dataclass(frozen=True)
class LabelledTurn:
    chat: str  # conversation file stem, e.g. "Chat_1_Emi_Elise"
    dia_id: str  # "D<session>:<turn>"
    split: str  # "tune" or "report" (benchmarks.memory.conversations.SPLITS)
    speaker: str
    text: str
    chat_time: str  # ISO 8601, UTC
    facts: tuple[str, ...]  # empty: the turn states nothing worth remembering


def split_of(chat: str) -> str:
    """'tune' or 'report' for a chat file stem, from benchmarks.memory.conversations.SPLITS."""
    for split, prefixes in SPLITS.items():
        if chat.startswith(prefixes):
            return split
    raise ValueError(f"chat {chat!r} is in no split of {sorted(SPLITS)}")


def sample_turn_ids(conversation: Conversation, seed: int = SEED) -> list[str]:
    """The dia_ids drawn from one conversation, in conversation order (deterministic for a seed)."""
    rng = random.Random(f"{seed}:{conversation.name}")
    eligible = [i for i, s in enumerate(conversation.sessions) if len(s.turns) >= MIN_SESSION_TURNS]
    chosen = sorted(rng.sample(eligible, min(SESSIONS_PER_CHAT, len(eligible))))
    ids = []
    for index in chosen:
        turns = conversation.sessions[index].turns
        picks = sorted(rng.sample(range(len(turns)), TURNS_PER_SESSION))
        ids.extend(turns[p].dia_id for p in picks)
    return ids


def read_labels(labels_path: Path = LABELS_PATH) -> dict:
    return json.loads(Path(labels_path).read_text(encoding="utf-8"))


def load_public_sample(
    labels_path: Path = LABELS_PATH, data_dir: Path = DEFAULT_DATA_DIR
) -> list[LabelledTurn]:
    """The labelled turns with their speaker, text and time read from the REALTALK files in data_dir.

    Raises FileNotFoundError naming the missing conversation file, KeyError naming a labelled turn the
    file does not have (or has without text), ValueError for a chat filed under the wrong split.
    """
    labels = read_labels(labels_path)
    data_dir = Path(data_dir)
    conversations: dict[str, dict] = {}
    result = []
    for entry in labels["turns"]:
        chat, dia_id = entry["chat"], entry["dia_id"]
        if chat not in conversations:
            path = data_dir / f"{chat}.json"
            if not path.is_file():
                raise FileNotFoundError(
                    f"{path} not found: the labels name chat {chat!r}; fetch REALTALK with "
                    f"`python -m benchmarks.memory.conversations --dest {data_dir}`"
                )
            conversation = load_conversation(path)
            conversations[chat] = {t.dia_id: t for s in conversation.sessions for t in s.turns}
        turn = conversations[chat].get(dia_id)
        if turn is None:
            raise KeyError(
                f"turn {dia_id} of {chat} is not in {data_dir / (chat + '.json')} (or has no text)"
            )
        if entry["split"] != split_of(chat):
            raise ValueError(
                f"{chat} {dia_id} is labelled split {entry['split']!r}, but {chat} is {split_of(chat)!r}"
            )
        facts = tuple(f["text"] for f in entry["facts"])
        result.append(
            LabelledTurn(chat, dia_id, entry["split"], turn.speaker, turn.text, turn.chat_time, facts)
        )
    return result


def counts(turns: list[LabelledTurn]) -> dict[str, dict[str, int]]:
    """Per split (and 'all'): turns, facts, turns with no fact, chats."""
    out = {}
    for split in (*SPLITS, "all"):
        part = [t for t in turns if split in ("all", t.split)]
        out[split] = {
            "turns": len(part),
            "facts": sum(len(t.facts) for t in part),
            "empty_turns": sum(not t.facts for t in part),
            "chats": len({t.chat for t in part}),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="counts of the labelled REALTALK formation sample")
    parser.add_argument("--labels", type=Path, default=LABELS_PATH)
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR, help="REALTALK data/Chat_*.json")
    args = parser.parse_args(argv)
    turns = load_public_sample(args.labels, args.data_dir)
    for split, c in counts(turns).items():
        print(
            f"{split:>6}: {c['turns']} turns from {c['chats']} chats, {c['facts']} facts, "
            f"{c['empty_turns']} turns with none"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

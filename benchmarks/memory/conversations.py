"""Multi-session conversation datasets with question -> evidence-turn annotations, in the LoCoMo JSON layout.

Owns reading one conversation file (`speaker_1/2`, `session_N` turn lists with `dia_id`, `session_N_date_time`,
`qa` with `evidence` dia_ids and `category`) into named records, cleaning the evidence ids real annotators
wrote ("D20:17.", "D 2:18", "D16:82. D19:2"), and the fixed tune/report split of REALTALK. REALTALK
(github.com/danny911kr/REALTALK) has no licence file, so it is not committed: `fetch` copies it from a clone.
Knows nothing of the store.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

REALTALK_REPO = "https://github.com/danny911kr/REALTALK"
REALTALK_COMMIT = "b903e06a9770bf4e5fe9018c3e132889666d3b4a"
# Fixed split by conversation, chosen before any measurement: odd-numbered chats tune, even-numbered report.
# Both halves mix short (Chat_1-4, ~450 turns) and long (Chat_5-10, ~1,000-1,500 turns) conversations.
SPLITS = {
    "tune": ("Chat_1_", "Chat_3_", "Chat_5_", "Chat_7_", "Chat_9_"),
    "report": ("Chat_2_", "Chat_4_", "Chat_6_", "Chat_8_", "Chat_10_"),
}
_SESSION_RE = re.compile(r"^session_(\d+)$")
_EVIDENCE_RE = re.compile(r"D\s*(\d+)\s*:\s*(\d+)")


@dataclass(frozen=True)
class Turn:
    dia_id: str
    speaker: str
    text: str
    chat_time: str  # ISO 8601, UTC


@dataclass(frozen=True)
class Session:
    session_id: str
    turns: tuple[Turn, ...]


@dataclass(frozen=True)
class Question:
    text: str
    evidence: tuple[str, ...]  # dia_ids of turns present in the conversation
    category: str
    num_dropped_evidence: int  # annotated ids that name no turn of the conversation


@dataclass(frozen=True)
class Conversation:
    name: str  # file stem
    sessions: tuple[Session, ...]
    questions: tuple[Question, ...]

    @property
    def num_turns(self) -> int:
        return sum(len(s.turns) for s in self.sessions)


def parse_time(value: str) -> str:
    """'29.12.2023, 22:42:04' (REALTALK) or '1:56 pm on 8 May, 2023' (LoCoMo) -> ISO 8601 UTC."""
    value = value.strip()
    for fmt in ("%d.%m.%Y, %H:%M:%S", "%I:%M %p on %d %B, %Y", "%Y-%m-%dT%H:%M:%S"):
        try:
            moment = datetime.strptime(value, fmt)
        except ValueError:
            continue
        return moment.replace(tzinfo=timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    raise ValueError(f"unknown date format {value!r}")


def clean_evidence(raw: list[str]) -> list[str]:
    """Every 'D<session>:<turn>' id inside the annotated strings, normalized, in order, without repeats."""
    found: list[str] = []
    for item in raw:
        found.extend(f"D{s}:{t}" for s, t in _EVIDENCE_RE.findall(str(item)))
    return list(dict.fromkeys(found))


def load_conversation(path: Path) -> Conversation:
    """One conversation file. Turns without text (photo-only messages) are skipped; so is evidence naming them."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    numbers = sorted(int(m.group(1)) for k in data if (m := _SESSION_RE.match(k)))
    sessions = []
    for number in numbers:
        default_time = data.get(f"session_{number}_date_time")
        turns = []
        for raw in data[f"session_{number}"]:
            text = (raw.get("clean_text") or raw.get("text") or "").strip()
            if not text:
                continue
            when = raw.get("date_time") or default_time
            turns.append(Turn(raw["dia_id"], raw["speaker"], text, parse_time(when)))
        if turns:
            sessions.append(Session(f"session_{number}", tuple(turns)))
    known = {t.dia_id for s in sessions for t in s.turns}
    questions = []
    for qa in data.get("qa", []):
        evidence = clean_evidence(qa.get("evidence", []))
        kept = tuple(e for e in evidence if e in known)
        questions.append(
            Question(qa["question"], kept, str(qa.get("category", "none")), len(evidence) - len(kept))
        )
    return Conversation(Path(path).stem, tuple(sessions), tuple(questions))


def load_split(data_dir: Path, split: str) -> list[Conversation]:
    """The conversations of `split` ('tune', 'report' or 'all') found in data_dir, in file-name order."""
    if split not in (*SPLITS, "all"):
        raise ValueError(f"split must be one of {[*SPLITS, 'all']}, got {split!r}")
    files = sorted(Path(data_dir).glob("*.json"))
    if split != "all":
        files = [f for f in files if f.name.startswith(SPLITS[split])]
    if not files:
        raise FileNotFoundError(f"no conversation files of split {split!r} in {data_dir}")
    return [load_conversation(f) for f in files]


def fetch(dest: Path, source: str = REALTALK_REPO, commit: str = REALTALK_COMMIT) -> list[Path]:
    """Copies REALTALK's data/Chat_*.json at `commit` from `source` (a URL or a local git dir) into `dest`.

    LoCoMo's copy under data/locomo/ is left out on purpose: it is the held-out set.
    """
    dest.mkdir(parents=True, exist_ok=True)
    git_dir = Path(source)
    if not git_dir.exists():
        git_dir = dest / "REALTALK.git"
        if not git_dir.exists():
            subprocess.run(["git", "clone", "--bare", "--quiet", source, str(git_dir)], check=True)
    names = subprocess.run(
        ["git", "--git-dir", str(git_dir), "ls-tree", "--name-only", commit, "data/"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    written = []
    for name in names:
        if re.fullmatch(r"data/Chat_\d+_\w+\.json", name):
            blob = subprocess.run(
                ["git", "--git-dir", str(git_dir), "show", f"{commit}:{name}"],
                check=True,
                capture_output=True,
            ).stdout
            target = dest / Path(name).name
            target.write_bytes(blob)
            written.append(target)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="fetch REALTALK conversations (not committed: no licence)")
    parser.add_argument("--dest", type=Path, default=Path.home() / ".cache/kvmem/datasets/realtalk")
    parser.add_argument("--source", default=REALTALK_REPO, help="git URL or a local (bare) clone")
    args = parser.parse_args(argv)
    for path in fetch(args.dest, args.source):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The labelled REALTALK formation sample: the labels file's shape, and load_public_sample on a fake data dir.

The checks against the real turns (no label copies its turn; the labelled turns are the seeded draw) run
where REALTALK is fetched (`python -m benchmarks.memory.conversations`, or KVMEM_REALTALK_DIR), and skip elsewhere.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from pathlib import Path

import pytest

from benchmarks.memory.conversations import (
    REALTALK_COMMIT,
    SPLITS,
    Conversation,
    Session,
    Turn,
    load_conversation,
)
from benchmarks.memory.formation_public import (
    DEFAULT_DATA_DIR,
    FACT_KINDS,
    LABELS_PATH,
    LabelledTurn,
    counts,
    load_public_sample,
    main,
    read_labels,
    sample_turn_ids,
    split_of,
)

REALTALK_DIR = Path(os.environ.get("KVMEM_REALTALK_DIR", DEFAULT_DATA_DIR))
MAX_SHARED_WORDS = 8  # a label sharing a longer run of words with its turn counts as copied


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9']+", text.lower().replace("\u2019", "'"))


def _longest_shared_run(a: list[str], b: list[str]) -> int:
    best = 0
    previous = [0] * (len(b) + 1)
    for x in a:
        current = [0] * (len(b) + 1)
        for j, y in enumerate(b, 1):
            if x == y:
                current[j] = previous[j - 1] + 1
                best = max(best, current[j])
        previous = current
    return best


def test_longest_shared_run():
    assert _longest_shared_run(_words("I went to the beach today"), _words("so I went to the beach")) == 5
    assert _longest_shared_run(_words("a b c"), _words("d e")) == 0


def test_labels_file_shape():
    labels = read_labels(LABELS_PATH)
    assert labels["dataset"] == "REALTALK"
    assert labels["commit"] == REALTALK_COMMIT
    assert "not double-annotated" in labels["labelled_by"].lower()
    assert labels["guidelines"].strip()
    turns = labels["turns"]
    assert len(turns) >= 100
    keys = [(t["chat"], t["dia_id"]) for t in turns]
    assert len(set(keys)) == len(keys), [k for k, n in Counter(keys).items() if n > 1]
    for turn in turns:
        assert set(turn) == {"chat", "dia_id", "split", "facts"}, turn
        assert re.fullmatch(r"Chat_\d+_\w+", turn["chat"]), turn
        assert re.fullmatch(r"D\d+:\d+", turn["dia_id"]), turn
        assert turn["split"] == split_of(turn["chat"]), turn
        for fact in turn["facts"]:
            assert set(fact) == {"text", "kind"}, turn
            assert fact["kind"] in FACT_KINDS, turn
            assert 0 < len(fact["text"].strip()) < 200, turn
        texts = [f["text"] for f in turn["facts"]]
        assert len(set(texts)) == len(texts), turn
    by_split = Counter(t["split"] for t in turns)
    assert set(by_split) == set(SPLITS) and min(by_split.values()) >= 50, by_split
    for split in SPLITS:
        assert len({t["chat"] for t in turns if t["split"] == split}) >= 4
    empty = sum(not t["facts"] for t in turns) / len(turns)
    assert 0.2 <= empty <= 0.5, empty  # a fair share of turns that state nothing memorable


def _write_chat(path: Path, speakers: tuple[str, str], sessions: list[list[tuple[str, str]]]) -> None:
    """A LoCoMo-layout conversation file: sessions of (speaker, text) turns, one minute apart."""
    data: dict = {"name": {"speaker_1": speakers[0], "speaker_2": speakers[1]}}
    for number, turns in enumerate(sessions, 1):
        date = f"{number:02d}.03.2024"
        data[f"session_{number}"] = [
            {
                "clean_text": text,
                "speaker": speaker,
                "date_time": f"{date}, 18:{minute:02d}:00",
                "img_file": [],
                "dia_id": f"D{number}:{minute + 1}",
            }
            for minute, (speaker, text) in enumerate(turns)
        ]
        data[f"session_{number}_date_time"] = f"{date}, 18:00:00"
    data["qa"] = []
    path.write_text(json.dumps(data), encoding="utf-8")


@pytest.fixture
def fake_data(tmp_path):
    data_dir = tmp_path / "realtalk"
    data_dir.mkdir()
    _write_chat(
        data_dir / "Chat_1_Ana_Ben.json",
        ("Ana", "Ben"),
        [[("Ana", "Hi Ben!"), ("Ben", "I adopted a beagle called Biscuit yesterday."), ("Ana", "")]],
    )
    _write_chat(
        data_dir / "Chat_2_Cleo_Dev.json",
        ("Cleo", "Dev"),
        [[("Cleo", "Morning")], [("Dev", "Back from Lisbon, loved it."), ("Cleo", "Welcome back")]],
    )
    labels = {
        "dataset": "REALTALK",
        "commit": REALTALK_COMMIT,
        "labelled_by": "test",
        "guidelines": "test",
        "turns": [
            {"chat": "Chat_1_Ana_Ben", "dia_id": "D1:1", "split": "tune", "facts": []},
            {
                "chat": "Chat_1_Ana_Ben",
                "dia_id": "D1:2",
                "split": "tune",
                "facts": [
                    {"text": "I adopted a beagle on 2024-02-29.", "kind": "event"},
                    {"text": "My beagle is called Biscuit.", "kind": "relation"},
                ],
            },
            {
                "chat": "Chat_2_Cleo_Dev",
                "dia_id": "D2:1",
                "split": "report",
                "facts": [{"text": "I enjoyed my trip to Lisbon.", "kind": "preference"}],
            },
        ],
    }
    labels_path = tmp_path / "labels.json"
    labels_path.write_text(json.dumps(labels), encoding="utf-8")
    return labels_path, data_dir, labels


def test_load_public_sample_on_fake_data(fake_data, capsys):
    labels_path, data_dir, _ = fake_data
    turns = load_public_sample(labels_path, data_dir)
    assert turns[1] == LabelledTurn(
        chat="Chat_1_Ana_Ben",
        dia_id="D1:2",
        split="tune",
        speaker="Ben",
        text="I adopted a beagle called Biscuit yesterday.",
        chat_time="2024-03-01T18:01:00.000000Z",
        facts=("I adopted a beagle on 2024-02-29.", "My beagle is called Biscuit."),
    )
    assert [(t.chat, t.dia_id, t.speaker, t.facts) for t in (turns[0], turns[2])] == [
        ("Chat_1_Ana_Ben", "D1:1", "Ana", ()),
        ("Chat_2_Cleo_Dev", "D2:1", "Dev", ("I enjoyed my trip to Lisbon.",)),
    ]
    assert counts(turns) == {
        "tune": {"turns": 2, "facts": 2, "empty_turns": 1, "chats": 1},
        "report": {"turns": 1, "facts": 1, "empty_turns": 0, "chats": 1},
        "all": {"turns": 3, "facts": 3, "empty_turns": 1, "chats": 2},
    }
    assert main(["--labels", str(labels_path), "--data-dir", str(data_dir)]) == 0
    out = capsys.readouterr().out
    assert "tune: 2 turns from 1 chats, 2 facts, 1 turns with none" in out
    assert "report: 1 turns from 1 chats, 1 facts, 0 turns with none" in out


@pytest.mark.parametrize(
    ("change", "error", "named"),
    [
        ({"chat": "Chat_4_Eve_Fay"}, FileNotFoundError, "Chat_4_Eve_Fay.json"),
        ({"dia_id": "D1:9"}, KeyError, "D1:9 of Chat_1_Ana_Ben"),
        ({"dia_id": "D1:3"}, KeyError, "D1:3 of Chat_1_Ana_Ben"),  # photo-only turn: no text
        ({"split": "report"}, ValueError, "Chat_1_Ana_Ben D1:1"),
    ],
)
def test_load_public_sample_names_what_is_missing(fake_data, change, error, named):
    labels_path, data_dir, labels = fake_data
    labels["turns"][0].update(change)
    if change.get("chat"):
        labels["turns"][0]["split"] = "report"
    labels_path.write_text(json.dumps(labels), encoding="utf-8")
    with pytest.raises(error, match=re.escape(named)):
        load_public_sample(labels_path, data_dir)


def test_sample_turn_ids_is_seeded_and_spread():
    sessions = tuple(
        Session(
            f"session_{s}", tuple(Turn(f"D{s}:{i}", "A", f"t{i}", "") for i in range(1, 13 if s != 2 else 4))
        )
        for s in range(1, 6)
    )
    conversation = Conversation("Chat_1_A_B", sessions, ())
    ids = sample_turn_ids(conversation, seed=7)
    assert ids == sample_turn_ids(conversation, seed=7)
    assert len(ids) == 15 and len(set(ids)) == 15
    assert not any(i.startswith("D2:") for i in ids)  # a 3-turn session is never drawn
    assert len({i.split(":")[0] for i in ids}) == 3
    assert ids != sample_turn_ids(conversation, seed=8)


def _realtalk_present() -> bool:
    return REALTALK_DIR.is_dir() and any(REALTALK_DIR.glob("Chat_*.json"))


@pytest.mark.skipif(not _realtalk_present(), reason=f"REALTALK not fetched into {REALTALK_DIR}")
def test_labels_are_not_copies_of_their_turns():
    turns = load_public_sample(LABELS_PATH, REALTALK_DIR)
    all_texts = {" ".join(_words(t.text)) for t in turns}
    for turn in turns:
        turn_words = _words(turn.text)
        for fact in turn.facts:
            fact_words = _words(fact)
            assert " ".join(fact_words) not in all_texts, (turn.chat, turn.dia_id, fact)
            assert _longest_shared_run(fact_words, turn_words) <= MAX_SHARED_WORDS, (
                turn.chat,
                turn.dia_id,
                fact,
            )


@pytest.mark.skipif(not _realtalk_present(), reason=f"REALTALK not fetched into {REALTALK_DIR}")
def test_labelled_turns_are_the_seeded_draw():
    labelled = [(t["chat"], t["dia_id"]) for t in read_labels(LABELS_PATH)["turns"]]
    drawn = []
    for chat in dict.fromkeys(chat for chat, _ in labelled):
        conversation = load_conversation(REALTALK_DIR / f"{chat}.json")
        drawn.extend((chat, dia_id) for dia_id in sample_turn_ids(conversation))
    assert labelled == drawn

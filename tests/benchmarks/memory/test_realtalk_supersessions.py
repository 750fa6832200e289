"""benchmarks.memory.realtalk_supersessions: one user's turns formed and consolidated in order, every
supersession listed with both texts."""

from __future__ import annotations

from benchmarks.memory.realtalk_supersessions import supersessions


def test_a_move_retires_the_home_and_talk_of_the_day_retires_nothing() -> None:
    turns = [
        ("I live in Leeds.", "2026-01-05T10:00:00.000000Z"),
        ("I just left the office, long day.", "2026-02-05T10:00:00.000000Z"),
        ("I moved to York last month.", "2026-03-05T10:00:00.000000Z"),
    ]
    formed, retired = supersessions(turns)
    assert formed == 3
    assert retired == [
        {
            "fact": "I moved to York in February 2026",
            "fact_slot": "user|home_city",
            "retired": "I live in Leeds",
            "retired_slot": "user|home_city",
        }
    ]

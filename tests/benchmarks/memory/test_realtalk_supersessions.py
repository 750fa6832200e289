"""benchmarks.memory.realtalk_supersessions: one user's turns formed and consolidated in order, every
supersession listed with both texts."""

from __future__ import annotations

from benchmarks.memory.realtalk_supersessions import supersessions


def test_a_move_retires_the_home_and_an_unrelated_statement_retires_nothing() -> None:
    turns = [
        ("I live in Leeds.", "2026-01-05T10:00:00.000000Z"),
        ("I bought a blue kettle.", "2026-02-05T10:00:00.000000Z"),
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


def test_a_fact_retired_by_a_later_one_of_its_own_turn_is_listed() -> None:
    formed, retired = supersessions(
        [("I live in Leeds. Actually I moved to York.", "2026-03-05T10:00:00.000000Z")]
    )
    assert formed == 2
    assert [(r["fact"], r["retired"]) for r in retired] == [("I moved to York", "I live in Leeds")]

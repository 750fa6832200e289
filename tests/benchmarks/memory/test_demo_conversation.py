"""benchmarks.memory.demo_conversation's scoring of one answer: right, echo (a run of five or more of the user's
own words) and the user's voice (their fact stated in the first person)."""

from __future__ import annotations

from benchmarks.memory.demo_conversation import STATEMENTS, echo_run, score


def test_an_answer_in_the_assistants_voice_is_right_and_no_echo() -> None:
    row = score("What is my husband's name?", "tiago", "Your husband's name is Tiago.", STATEMENTS)
    assert (row["right"], row["echo_run"], row["echo"], row["user_voice"]) == (True, 1, False, False)


def test_an_echo_of_the_users_statement_is_counted() -> None:
    answer = "Hi! I live in Porto with my husband Tiago."
    assert echo_run(answer, STATEMENTS) == 8
    row = score("Where do I live?", "porto", answer, STATEMENTS)
    assert (row["right"], row["echo"], row["user_voice"]) == (True, True, True)


def test_a_wrong_answer_in_the_users_voice() -> None:
    row = score("What is my cat's name?", "biscuit", "My cat is Lia.", STATEMENTS)
    assert (row["right"], row["echo"], row["user_voice"]) == (False, False, True)

"""Pieces of the transformers backend that need no model: stop strings across token boundaries."""

from __future__ import annotations

from serving.backends.transformers_backend import _StopMatcher


def run(stops, deltas):
    m = _StopMatcher(stops)
    out, hit = [], False
    for d in deltas:
        ready, hit = m.feed(d)
        out.append(ready)
        if hit:
            break
    if not hit:
        out.append(m.flush())
    return "".join(out), hit, out


def test_stop_split_across_tokens_is_never_emitted():
    text, hit, pieces = run(["END"], ["Hello E", "N", "D and more"])
    assert (text, hit) == ("Hello ", True)
    assert pieces == ["Hello ", "", ""]


def test_held_back_prefix_is_released_when_it_does_not_become_a_stop():
    text, hit, pieces = run(["END"], ["Hello E", "N", "ough"])
    assert (text, hit) == ("Hello ENough", False)
    assert pieces == ["Hello ", "", "ENough", ""]


def test_earliest_of_several_stops_wins_and_no_stops_passes_through():
    assert run(["b", "a"], ["xxab"])[:2] == ("xx", True)
    assert run([], ["a", "b"])[:2] == ("ab", False)

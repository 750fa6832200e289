"""The stop-string matcher every backend uses: exact output across token boundaries (examples, and a property
test against a naive reference over the whole text), and work per token bounded whatever came before."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from serving.chat.service import MAX_STOP_CHARS, MAX_STOP_STRINGS
from serving.engine.stops import StopMatcher


def run(stops, deltas):
    m = StopMatcher(stops)
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
    assert run(["", "b"], ["ab"])[:2] == ("a", True)  # an empty stop string never matches


def test_the_stop_that_ends_first_wins_however_the_text_is_split():
    # "bc" is complete at the third character, before "abcd" could be: the same cut in one delta or four
    assert run(["abcd", "bc"], ["abcd"])[:2] == ("a", True)
    assert run(["abcd", "bc"], ["a", "b", "c", "d"])[:2] == ("a", True)
    # of two ending at the same character, the longer one counts
    assert run(["cd", "bcd"], ["abcde"])[:2] == ("a", True)
    # overlapping prefixes: "aab" after "aaa" (KMP fallback), held back until it completes
    assert run(["aab"], ["aa", "a", "b!"])[:3] == ("a", True, ["", "a", ""])


def reference(stops: list[str], text: str) -> tuple[str, bool]:
    """Naive: the first position where some stop string is complete (the longest there), cut at its start."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if s and text[:end].endswith(s)]
        if done:
            return text[: end - max(map(len, done))], True
    return text, False


def held_back(stops: list[str], text: str) -> int:
    """Naive: the longest end of `text` that is a proper prefix of some stop string."""
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


@settings(max_examples=400, deadline=None)
@given(
    stops=st.lists(st.text("abc", min_size=0, max_size=6), max_size=MAX_STOP_STRINGS),
    deltas=st.lists(st.text("abc", max_size=5), max_size=12),
)
def test_matches_the_naive_reference_across_any_token_boundaries(stops, deltas):
    m = StopMatcher(stops)
    emitted, seen, hit = "", "", False
    for delta in deltas:
        ready, hit = m.feed(delta)
        emitted += ready
        seen += delta
        if hit:
            break
        assert emitted == seen[: len(seen) - held_back(stops, seen)]  # holds back exactly what it must
        assert m.pending == seen[len(emitted) :]
    if not hit:
        emitted += m.flush()
    assert (emitted, hit) == reference(stops, seen)


def test_work_per_token_is_bounded_with_max_length_hostile_stop_strings():
    """A request with the longest allowed stop strings, built so naive matching backtracks the most, and many
    tokens that keep them almost matching: every feed does at most stops x (2 x len(delta) + longest stop)
    automaton moves, however long the generation has run, so its turn on the model thread stays short."""
    n = MAX_STOP_CHARS
    stops = ["a" * (n - 1) + "b", "a" * (n - 2) + "ba", ("ab" * n)[:n], "a" * (n - 1) + "c"]
    assert len(stops) == MAX_STOP_STRINGS and all(len(s) == n for s in stops)
    m = StopMatcher(stops)
    deltas = ["a" * 7, "a", "a" * 40, "ab", "a" * (n - 3), "ba"] * 500
    total = 0
    for delta in deltas:
        before = m.work
        ready, hit = m.feed(delta)
        assert not hit
        assert m.work - before <= len(stops) * (2 * len(delta) + n)
        assert len(m.pending) < n
        total += len(delta)
    assert m.work <= len(stops) * 2 * total

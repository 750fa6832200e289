"""Stop strings over streamed text: which text is safe to emit now, and where the first stop string ends.

Owns the matching only, for every backend, so a stop string behaves the same whatever produced the text.
How many stop strings a request may give and how long they may be is the chat path's rule (serving/chat/service.py).
"""

from __future__ import annotations

from collections.abc import Sequence


def _failure(stop: str) -> tuple[int, ...]:
    """KMP failure function: fail[i] is the length of the longest proper prefix of stop[:i + 1] that is
    also a suffix of it."""
    fail = [0] * len(stop)
    k = 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = fail[k - 1]
        if stop[i] == stop[k]:
            k += 1
        fail[i] = k
    return tuple(fail)


class StopMatcher:
    """Finds stop strings across token boundaries in one pass over the text; holds back text that could
    still become a stop string.

    Generation stops where the first stop string ends (of several ending at the same character, the longest
    counts); the text before its start is emitted, the stop string and anything after it never are. The
    result depends on the text only, not on how it was split into deltas.

    Why an automaton per stop string rather than searching the pending text: every character fed moves each
    automaton once (plus fallbacks bounded by the characters fed before), so a feed costs
    O(number of stops x (len(delta) + longest stop)) whatever came before, on the model thread that serves
    every user; the held-back text is always shorter than the longest stop string. `work` counts automaton
    moves, so tests can assert that bound.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(dict.fromkeys(x for x in stops if x))  # empty strings never match; no duplicates
        self._fail = tuple(_failure(x) for x in self.stops)
        self._matched = [0] * len(self.stops)  # per stop: how much of it the text now ends with
        self.pending = ""  # held back: the longest end of the text that is a prefix of some stop string
        self.hit = False
        self.work = 0

    def feed(self, delta: str) -> tuple[str, bool]:
        """Returns (text safe to emit now, whether a stop string was found). Not to be fed after a hit."""
        assert not self.hit, "fed after a stop string was found"
        if not self.stops:
            return delta, False
        text = self.pending + delta
        base = len(self.pending)
        for offset, ch in enumerate(delta):
            longest = 0
            for j, stop in enumerate(self.stops):
                k, fail = self._matched[j], self._fail[j]
                while k and stop[k] != ch:
                    k = fail[k - 1]
                    self.work += 1
                if stop[k] == ch:
                    k += 1
                self.work += 1
                self._matched[j] = k
                if k == len(stop):
                    longest = max(longest, k)
            if longest:
                self.pending, self.hit = "", True
                return text[: base + offset + 1 - longest], True
        held = max(self._matched)
        out, self.pending = text[: len(text) - held], text[len(text) - held :]
        return out, False

    def flush(self) -> str:
        """The held-back text, at the end of generation (no stop string can complete any more)."""
        out, self.pending = self.pending, ""
        return out

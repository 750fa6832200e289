"""A page pool's free pages as runs of consecutive pages (pages.py's PagePool keeps its free list in one).

Taking n pages costs O(log runs), not a sort of every free page (100k+ pages on a large GPU), and a freed
page merges with its neighbours in O(1). Knows nothing of K/V, references or items.
"""

from __future__ import annotations

import heapq


class FreeRuns:
    """The free pages as runs of consecutive pages: `take` finds a run of n in O(log runs), not by sorting
    every free page (100k pages on a large GPU). Runs are kept by start and by end (a freed page merges with
    its neighbours in O(1)) and in a heap by length, longest first (entries checked when popped: a run that
    merged or was taken since is skipped). Single free pages are kept apart and used first for one-page
    takes (a decode crossing into a page), so the long runs stay long for prompts and builds."""

    def __init__(self, num_pages: int) -> None:
        self._length: dict[int, int] = {}  # start -> length
        self._start: dict[int, int] = {}  # end (exclusive) -> start
        self._heap: list[tuple[int, int]] = []  # (-length, start), stale entries skipped
        self._singles: dict[int, None] = {}  # starts of the runs of length 1 (an ordered set)
        self.count = 0
        if num_pages:
            self._add_run(0, num_pages)
            self.count = num_pages

    def _add_run(self, start: int, length: int) -> None:
        self._length[start] = length
        self._start[start + length] = start
        if length == 1:
            self._singles[start] = None
        else:
            heapq.heappush(self._heap, (-length, start))
            if len(self._heap) > 2 * len(self._length) + 64:  # drop the stale entries now and then
                self._heap = [(-n, s) for s, n in self._length.items() if n > 1]
                heapq.heapify(self._heap)

    def _remove_run(self, start: int) -> int:
        length = self._length.pop(start)
        del self._start[start + length]
        self._singles.pop(start, None)
        return length

    def add(self, page: int) -> None:
        """One page is free again (merged with the runs either side of it)."""
        start, length = page, 1
        left = self._start.get(page)
        if left is not None:
            length += self._remove_run(left)
            start = left
        if page + 1 in self._length:
            length += self._remove_run(page + 1)
        self._add_run(start, length)
        self.count += 1

    def _longest(self) -> tuple[int, int] | None:
        while self._heap:
            negative, start = self._heap[0]
            if self._length.get(start) == -negative:
                return start, -negative
            heapq.heappop(self._heap)
        return None

    def take(self, n: int) -> list[int]:
        """n free pages (the caller checked `count`): a single page when one is apart, else the first n of
        the longest run, which is one run when any run has n; else the longest runs' pages until n."""
        assert n <= self.count
        out: list[int] = []
        while len(out) < n:
            if n - len(out) == 1 and self._singles:
                start = next(iter(self._singles))
                self._remove_run(start)
                out.append(start)
                continue
            found = self._longest()
            if found is None:  # only single pages are left
                start = next(iter(self._singles))
                self._remove_run(start)
                out.append(start)
                continue
            start, length = found
            k = min(length, n - len(out))
            self._remove_run(start)
            if length > k:
                self._add_run(start + k, length - k)
            out.extend(range(start, start + k))
        self.count -= n
        return out

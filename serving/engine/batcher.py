"""The sequences the model loop decodes together, and the step that advances them all (on the model thread).

A request's generator hands its `EngineSequence` (sequence.py) to the model loop by yielding it; from then on
the batcher resumes it with `send(token)` for each token the sequence produces and `send(None)` once the
sequence has ended (length, stop token, cancelled). The request returns when it is done with the stream (a stop
string, an end token, the None); an exception thrown into it is a failure of its own sequence.

One step: cancellations are taken at the boundary; then prefill chunks of waiting sequences, oldest first,
up to `prefill_budget_tokens` (at least one chunk, so a long prompt goes in pieces and others keep streaming),
and the decode row of every decoding sequence, all in one forward of the engine per model (runner.step); a
sequence whose prompt completes in a step then decodes from the next one. Knows nothing of HTTP or the KV
store.

Pages (table.py): a sequence holds pages for the tokens it has, not for its longest reply. Before a step,
each sequence in it gets a page for the tokens it writes, oldest admitted first; when the pool has none
(after evicting unread items and live sessions), the newest admitted sequence that holds own pages is
preempted, then the next newest, as vLLM does (so the oldest requests finish first and the newest, which
have done the least work, redo it): its own pages go back and, once admitted again, it prefills its prompt
and the tokens it generated again (recompute, as nano-vllm) and goes on from there; its stream sees no gap
but time. A sequence that is itself the newest holding pages is preempted when it finds none. Preempted
sequences are admitted again oldest first, before any new request (a new request waits while one is
preempted: PageTable.admit). If nothing can run (every member is preempted, or the only ones that are not
are background members, which wait while a chat member does) and the first waiting member cannot get its
pages back while another member holds pages (the shared pages it reads, its own), one of those fails with
PoolFull: the youngest background member, else the youngest chat member. When no other member holds pages,
the members wait for the pool to change (another thread's release: a delete, a build), but not forever: the
first that waits fails with PoolFull once nothing could run for its admission's `wait_s` (429, as a request
that waits at admission), and a member whose caller stopped ends meanwhile (`idle` is false then).

Background rows (`seq.background`: memory formation on the server's own model, serving/background/) run at
low priority, within this budget: they take no step while a chat (foreground) member waits to be admitted
again after a preemption; at most `background_rows` of them (oldest first) are in a step; their prefill chunks
come after every chat member's, from what the prefill budget leaves (a chat row's chunk is never pushed to a
later step by one); and they are preempted before any chat member when a step needs pages. So a chat row is
in every step from its admission to its end as it would be without them (0 steps of delay); what a
formation row adds to a step it shares with chat rows is at most `background_rows` rows, each a decode token
or a paced prefill chunk (EngineSequence.pace: small while streams decode).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Generator
from typing import Any

from serving.engine import runner
from serving.engine.pages import PoolFull
from serving.engine.sequence import EngineSequence, SequenceError

log = logging.getLogger(__name__)

RequestSteps = Generator[Any, int | None, None]


class Batcher:
    def __init__(self, prefill_budget_tokens: int = 512, background_rows: int = 1) -> None:
        if prefill_budget_tokens < 1:
            raise ValueError(f"prefill_budget_tokens must be >= 1, got {prefill_budget_tokens}")
        if background_rows < 1:
            raise ValueError(f"background_rows must be >= 1, got {background_rows}")
        self.prefill_budget_tokens = prefill_budget_tokens
        self.background_rows = background_rows
        self._members: dict[EngineSequence, RequestSteps] = {}  # insertion order: the prefill queue's order
        self._stalled: dict[object, int] | None = None  # every member preempted: each pool's generation then
        self._stall_began: float | None = None  # time.monotonic() when nothing could run, since then

    def __len__(self) -> int:
        return len(self._members)

    def add(self, seq: EngineSequence, steps: RequestSteps) -> None:
        """`steps` yielded `seq` and waits for its first token (or None)."""
        assert seq not in self._members
        self._members[seq] = steps
        self._stalled = None  # a new member may run: the batcher is not idle until a step says so again

    def idle(self) -> bool:
        """Every member is preempted, no pool has had room appear since they last failed to get pages, no
        member's caller stopped and no wait is over: a step would do nothing (the model loop waits for a
        pool's change, a wake-up or `deadline` instead of stepping)."""
        if self._stalled is None or any(p.generation != g for p, g in self._stalled.items()):
            return False
        if any(s.should_stop is not None and s.should_stop() for s in self._members):
            return False
        deadline = self.deadline()
        return deadline is None or time.monotonic() < deadline

    def deadline(self) -> float | None:
        """While stalled: when a preempted member's wait is over (time.monotonic(), counted from the moment
        nothing could run, not from its preemption: a member preempted long ago while others ran gets its
        whole wait), else None."""
        if self._stalled is None or self._stall_began is None:
            return None
        return min((self._stall_began + s.wait_s for s in self._members if s.preempted), default=None)

    def step(self) -> None:
        """Advance every member by at most one model step (see the module docstring)."""
        for seq in list(self._members):
            if seq.check_cancel():
                self._deliver(seq, None)
        self._readmit()
        budget, chunks = self.prefill_budget_tokens, []
        busy = any(s.decoding for s in self._members)
        for seq in self._members:
            if seq.prefilling:
                seq.pace(busy)  # a block build's or a formation row's chunk: small while streams decode
        members = self._stepping()
        for seq in members:  # chat members first: a background chunk takes what their chunks leave
            if budget <= 0:
                break
            if seq.prefilling:
                budget -= seq.next_chunk_tokens()
                chunks.append(seq)
        self._make_room(chunks, members)
        chunks = [s for s in chunks if not s.preempted]
        for model in {id(s.model): s.model for s in members}.values():  # the engine: one forward per model
            prefills = [s for s in chunks if s.model is model]
            decodes = [s for s in members if s.model is model and s.decoding]
            if prefills or decodes:
                pool = (prefills + decodes)[0].table.pool
                for seq, token in zip(
                    prefills + decodes, runner.step(model, pool, prefills, decodes), strict=True
                ):
                    self._settle(seq, token)

    def _stepping(self) -> list[EngineSequence]:
        """The members this step may run, chat members first (admission order), then at most
        `background_rows` background members (oldest first), none while a chat member waits to be admitted
        again (see the module docstring)."""
        chat = [s for s in self._members if not s.background]
        if any(s.preempted for s in chat):
            return chat
        return chat + [s for s in self._members if s.background and not s.preempted][: self.background_rows]

    def _readmit(self) -> None:
        """Preempted members get their pages back, oldest first, while the pool has them (a younger one never
        goes before an older one that waits). Chat members go first; a background row or a build (its table's
        `background`) only behind them and behind every chat request waiting at admission (waiting.py)."""
        self._stalled = None
        waiting = sorted((s for s in self._members if s.preempted), key=lambda s: s.table.background)
        # read before the tries: room that appears after them (another thread's release) makes `idle` false
        generations = {s.table.pool: s.table.pool.generation for s in waiting}
        blocked = set()  # pools whose oldest preempted member found no room
        for seq in waiting:
            pool = seq.table.pool
            if pool in blocked:
                continue
            # a background row or build holding no pages waits behind the chat requests waiting at admission
            # (the pages it would take are theirs); one still holding some (the block it reads) is let back in,
            # to finish and give them all back
            behind_chat = seq.table.background and not seq.table.pages and pool.waiting.ahead(None, False) > 0
            if behind_chat or not seq.readmit():
                blocked.add(pool)
        if not blocked or any(not s.preempted for s in self._stepping()):
            self._stall_began = None
            return
        # nothing runs (a background member that is not preempted takes no step while a chat member waits),
        # so no page comes back by a step: a member holding pages (the shared ones it reads, its own) other
        # than the first that waits fails, every background member before a chat one, the youngest first;
        # else the members wait for the pool to change (a finished build's pages)
        for pool in blocked:
            first = next(s for s in waiting if s.preempted and s.table.pool is pool)
            holders = [s for s in self._members if s is not first and s.table.pool is pool and s.table.pages]
            background = [s for s in holders if s.background]
            if holders:
                seq = (background or holders)[-1]
                self._fail(seq, PoolFull("preempted, and the KV pool cannot hold it with the older requests"))
                self._stall_began = None
                return
        now = time.monotonic()
        if self._stall_began is None:
            self._stall_began = now
        for seq in [s for s in waiting if s.preempted and now >= self._stall_began + s.wait_s]:
            self._fail(
                seq,
                PoolFull(
                    f"preempted, and the KV pool gave no pages back in {seq.wait_s:g} s "
                    f"({seq.table.pool.free_pages} of {seq.table.pool.num_pages} free)"
                ),
            )
            self._stall_began = None  # its pages went back: the others' waits start again if still stalled
            return
        self._stalled = generations

    def _make_room(self, chunks: list[EngineSequence], rows: list[EngineSequence]) -> None:
        """A page for every position the step writes (`rows`: the members it may run), oldest admitted first;
        the newest admitted members holding own pages are preempted for them when the pool has none, every
        background member before any chat member (see the module docstring)."""
        chat = [s for s in self._members if not s.background]
        background = [s for s in self._members if s.background]
        stepping, allowed = set(chunks), set(rows)
        for seq in chat + background:
            if seq.preempted or seq not in allowed or not (seq in stepping or seq.decoding):
                continue
            end = seq.position + seq.step_tokens()
            while not seq.table.grow(end):
                if seq.background:  # only a newer background member
                    later = background[background.index(seq) + 1 :][::-1]
                else:  # any background member, then a newer chat member
                    later = background[::-1] + chat[chat.index(seq) + 1 :][::-1]
                victim = next(
                    (
                        v
                        for v in later
                        if not v.preempted
                        and not v.finished
                        and v.table.pool is seq.table.pool
                        and v.table.own_pages() > 0
                    ),
                    None,
                )
                if victim is None:
                    seq.preempt()
                    break
                victim.preempt()

    def _settle(self, seq: EngineSequence, token: int | SequenceError | None) -> None:
        if isinstance(token, SequenceError):
            self._fail(seq, token.cause)
        elif token is not None:
            self._deliver(seq, token)

    def close(self) -> None:
        """Drop every member (the model loop closed): their generators are closed."""
        members, self._members = self._members, {}
        for steps in members.values():
            steps.close()

    def _deliver(self, seq: EngineSequence, token: int | None) -> None:
        """Resume the request with `token`; once the sequence has ended, with None; drop it when it returns."""
        steps = self._members[seq]
        try:
            steps.send(token)
            if token is not None and seq.finished:
                steps.send(None)
            if seq.finished:
                raise RuntimeError("a request went on after its sequence ended")
        except StopIteration:
            del self._members[seq]
        except Exception:  # noqa: BLE001 - the loop must outlive any one request
            log.exception("a request's steps raised out of the batcher; request dropped")
            self._drop(seq)

    def _fail(self, seq: EngineSequence, exc: BaseException) -> None:
        """The sequence's own step failed: the request gets the exception (it reports it and returns)."""
        steps = self._members[seq]
        try:
            steps.throw(exc)
        except StopIteration:
            del self._members[seq]
            return
        except BaseException as again:  # noqa: BLE001 - it did not handle its error: logged, dropped
            if again is not exc:
                log.exception("a request failed while handling its error; request dropped")
            else:
                log.error("a request's sequence failed: %s", exc)
        self._drop(seq)

    def _drop(self, seq: EngineSequence) -> None:
        steps = self._members.pop(seq, None)
        if steps is not None:
            steps.close()

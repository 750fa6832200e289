"""The sequences the model loop decodes together, and the step that advances them all (on the model thread).

A request's generator hands its `Sequence` (percache/batch.py) to the model loop by yielding it; from then on
the batcher resumes it with `send(token)` for each token the sequence produces and `send(None)` once the
sequence has ended (length, stop token, cancelled). The request returns when it is done with the stream (a stop
string, an end token, the None); an exception thrown into it is a failure of its own sequence.

One step: cancellations are taken at the boundary; then prefill chunks of waiting sequences, oldest first,
up to `prefill_budget_tokens` (at least one chunk, so a long prompt goes in pieces and others keep streaming);
then one batched decode step of every decoding sequence. With `packed` (the default) the chunks and the decode
steps of a model's sequences run as one forward (percache/packed.py); a sequence whose prompt completes in a
step then decodes from the next one. Knows nothing of HTTP or the KV store.
"""

from __future__ import annotations

import logging
from collections.abc import Generator
from typing import Any

from serving.engine import runner
from serving.engine.percache import packed as packing
from serving.engine.percache.batch import Sequence, SequenceError, can_batch, decode_step
from serving.engine.sequence import PagedSequence

log = logging.getLogger(__name__)

RequestSteps = Generator[Any, int | None, None]


class Batcher:
    def __init__(self, prefill_budget_tokens: int = 512, packed: bool = True) -> None:
        if prefill_budget_tokens < 1:
            raise ValueError(f"prefill_budget_tokens must be >= 1, got {prefill_budget_tokens}")
        self.prefill_budget_tokens = prefill_budget_tokens
        self.packed = packed
        self._members: dict[Sequence, RequestSteps] = {}  # insertion order: the prefill queue's order

    def __len__(self) -> int:
        return len(self._members)

    def add(self, seq: Sequence, steps: RequestSteps) -> None:
        """`steps` yielded `seq` and waits for its first token (or None)."""
        assert seq not in self._members
        self._members[seq] = steps

    def step(self) -> None:
        """Advance every member by at most one model step (see the module docstring)."""
        for seq in list(self._members):
            if seq.check_cancel():
                self._deliver(seq, None)
        budget, chunks = self.prefill_budget_tokens, []
        busy = any(s.decoding for s in self._members)
        for seq in self._members:
            if isinstance(seq, PagedSequence) and seq.prefilling:
                seq.pace(busy)  # a block build's chunk: small while streams decode
        for seq in self._members:
            if budget <= 0:
                break
            if seq.prefilling:
                budget -= seq.next_chunk_tokens()
                chunks.append(seq)
        paged = [s for s in self._members if isinstance(s, PagedSequence)]
        for model in {id(s.model): s.model for s in paged}.values():  # the engine: one forward per model
            prefills = [s for s in chunks if s.model is model and isinstance(s, PagedSequence)]
            decodes = [s for s in paged if s.model is model and s.decoding]
            if prefills or decodes:
                pool = (prefills + decodes)[0].table.pool
                for seq, token in zip(
                    prefills + decodes, runner.step(model, pool, prefills, decodes), strict=True
                ):
                    self._settle(seq, token)
        chunks = [s for s in chunks if not isinstance(s, PagedSequence)]
        members = [s for s in self._members if not isinstance(s, PagedSequence)]
        models = {id(s.model): s.model for s in members}
        packed = {m for m, model in models.items() if self.packed and can_batch(model)}
        decoding = [s for s in members if s.decoding and id(s.model) in packed]
        for m in packed:
            prefills = [s for s in chunks if id(s.model) == m]
            decodes = [s for s in decoding if id(s.model) == m]
            if prefills or decodes:
                results = packing.step(models[m], prefills, decodes)
                for seq, token in zip(prefills + decodes, results, strict=True):
                    self._settle(seq, token)
        for seq in chunks:
            if id(seq.model) in packed or seq not in self._members:
                continue
            try:
                token = seq.prefill_step()
            except Exception as exc:  # noqa: BLE001 - this request's failure, handed to it
                seq.finish_reason = "error"
                self._fail(seq, exc)
                continue
            if token is not None:
                self._deliver(seq, token)
        decoding = [
            s
            for s in self._members
            if s.decoding and id(s.model) not in packed and not isinstance(s, PagedSequence)
        ]
        for model in {id(s.model): s.model for s in decoding}.values():
            group = [s for s in decoding if s.model is model]
            for seq, token in zip(group, decode_step(model, group), strict=True):
                self._settle(seq, token)

    def _settle(self, seq: Sequence, token: int | SequenceError | None) -> None:
        if isinstance(token, SequenceError):
            self._fail(seq, token.cause)
        elif token is not None:
            self._deliver(seq, token)

    def close(self) -> None:
        """Drop every member (the model loop closed): their generators are closed."""
        members, self._members = self._members, {}
        for steps in members.values():
            steps.close()

    def _deliver(self, seq: Sequence, token: int | None) -> None:
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

    def _fail(self, seq: Sequence, exc: BaseException) -> None:
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

    def _drop(self, seq: Sequence) -> None:
        steps = self._members.pop(seq, None)
        if steps is not None:
            steps.close()

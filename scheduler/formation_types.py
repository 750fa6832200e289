"""The formation worker's shapes (formation.py): its bounds and failure rules (`FormationConfig`), what one pass
did (`PassResult`), its counters since start (`FormationStats`, /metrics and /health), what a pass's sub-batches
did summed (`Tally`), and a store turn as an extractor reads it (`to_input`). Knows nothing of threads."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvmem.formation.types import TurnInput


@dataclass(frozen=True)
class FormationConfig:
    """Bounds and failure rules of the formation worker.

    A batch that fails with a transient error stays pending and its user is tried again after
    `retry_backoff_s * 2**(attempts-1)` seconds, at most `max_backoff_s`; `circuit_failures` transient failures
    in a row (any users) open the circuit: no pass for `retry_backoff_s`, doubling per failed probe up to
    `max_backoff_s`, then one probe pass; an answer closes it and every queued user is due at once. A batch
    that fails with a permanent error is split in halves, each formed on its own, down to single turns, which
    are dead-lettered with the reason (`GET /v1/memories/formation`); `requeue_dead` puts them back.
    """

    max_queued_users: int = 10_000
    batch_turns: int = 32  # turns handed to the extractor at once (one user's, oldest first)
    retry_backoff_s: float = 2.0
    max_backoff_s: float = 300.0
    circuit_failures: int = 3
    rescan_interval_s: float = 30.0
    num_dense_candidates: int = 5  # nearest served memories checked as near-duplicates of each new fact

    def __post_init__(self) -> None:
        for name in ("max_queued_users", "batch_turns", "circuit_failures", "num_dense_candidates"):
            if getattr(self, name) < 1:
                raise ValueError(f"FormationConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("retry_backoff_s", "max_backoff_s", "rescan_interval_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"FormationConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.max_backoff_s < self.retry_backoff_s:
            raise ValueError(
                f"FormationConfig.max_backoff_s must be >= retry_backoff_s ({self.retry_backoff_s}), "
                f"got {self.max_backoff_s}"
            )


@dataclass(frozen=True)
class PassResult:
    """What one pass over a user's pending turns did."""

    num_turns: int  # turns read
    num_added: int
    num_duplicates: int
    num_superseded: int
    num_dropped: int  # facts whose turns were deleted while they were formed
    error: str | None = None  # the extractor's last failure (its turns stay pending or were dead-lettered)
    num_dead: int = 0  # turns dead-lettered (each failed alone with a permanent error)
    transient: bool = False  # the pass stopped at a transient failure: the rest of the batch is pending

    @property
    def dead(self) -> bool:
        return self.num_dead > 0


@dataclass
class FormationStats:
    """Counters since start (the store holds the durable pending / dead counts)."""

    queued_users: int = 0
    formed_turns_total: int = 0
    memories_added_total: int = 0
    superseded_total: int = 0
    duplicates_total: int = 0
    failures_total: int = 0
    dead_lettered_total: int = 0
    overflowed_total: int = 0
    stale_total: int = 0  # passes whose memories changed while they decided: decided again, nothing written
    last_error_kind: str | None = None  # ExtractionError.kind, or "store:<exception type>"; never user text
    last_error_at: str | None = None  # when (UTC, ISO 8601)
    circuit: str = "closed"  # "closed" | "open" (no pass but one probe from circuit_until on)
    circuit_until: str | None = None  # when an open circuit lets a probe through (UTC, ISO 8601)
    circuit_open: int = 0  # 1 while not "closed" (a gauge)
    extractor: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Tally:
    """What a pass's sub-batches did, summed."""

    added: int = 0
    duplicates: int = 0
    superseded: int = 0
    dropped: int = 0
    dead: int = 0
    error: str | None = None
    transient: bool = False


def to_input(turn: Any) -> TurnInput:
    """A store Turn as the extractor reads it."""
    return TurnInput(
        id=turn.id,
        role=turn.role or "user",
        text=turn.text,
        chat_time=turn.chat_time,
        session_id=turn.session_id,
        speaker=turn.speaker,
    )

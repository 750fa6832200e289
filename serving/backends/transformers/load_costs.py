"""Load or recompute: what bringing a stored block into the engine's pages costs from the tier that holds it,
against prefilling its tokens as text, on this machine; the cheaper path is taken per block.

A block in the pool (the device tier) costs nothing. From host RAM it costs a copy into pages; from disk a file
read (verified) into RAM, then that copy. Each rate is measured here: the prefill's by a probe when the model
loads (`PROBE_TOKENS` tokens prefilled in the engine), the tiers' from every load the backend made since start
(file reads on the I/O threads, copies into pages on the model thread), bytes over seconds. A
tier not measured yet is loaded: its loads measure it. `LoadCosts(..., fixed=True)` sets the
rates (tests; a deployment that knows them). A tier is loaded until its loads cover MIN_MEASURED_BYTES; a
recompute must save MIN_GAIN_S at least. Thread-safe. Knows nothing of the store, the pool or requests.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

PROBE_TOKENS = 256  # the prefill probe at load: long enough that a forward's fixed cost is a small share
TIERS = ("pool", "host", "disk")  # fastest first; "pool" is the engine's page pool, the device tier
PATHS = ("load", "recompute")
# a recompute is taken only when it saves at least this much: below it the two paths differ by less than a
# step's noise, and a load leaves the block in pages and RAM for the next request, a recompute does not
MIN_GAIN_S = 0.01
# a tier's measured rate is used once its loads cover this many bytes: a small load's time is mostly a fixed
# cost (a file's open and parse, a copy's launch), which a rate per byte would charge every byte of a block
MIN_MEASURED_BYTES = 16 << 20


@dataclass(frozen=True)
class Decision:
    """How a request's block is served. tier: where it is ("pool", "host", "disk"), None when not stored;
    path: "load" (its K/V into pages) or "recompute" (its tokens prefilled as text), None when not stored;
    the two estimates in seconds (None: not measured yet)."""

    tier: str | None
    path: str | None
    load_s: float | None
    recompute_s: float | None

    def to_dict(self) -> dict:
        return {"tier": self.tier, "path": self.path, "load_s": self.load_s, "recompute_s": self.recompute_s}


class LoadCosts:
    """Seconds per byte of a load from each tier, seconds per token of a prefill; `decide` compares them."""

    def __init__(
        self,
        prefill_s_per_token: float | None = None,
        load_s_per_byte: dict[str, float] | None = None,
        *,
        fixed: bool = False,
        min_gain_s: float = MIN_GAIN_S,
    ) -> None:
        given = dict(load_s_per_byte or {})
        unknown = set(given) - {"host", "disk"}
        if unknown:
            raise ValueError(f"load costs are per tier host or disk, got {sorted(unknown)}")
        if any(v < 0 for v in given.values()) or (
            prefill_s_per_token is not None and prefill_s_per_token < 0
        ):
            raise ValueError("load and prefill costs must be >= 0")
        self._lock = threading.Lock()
        self.fixed, self.min_gain_s = fixed, min_gain_s
        self._prefill = prefill_s_per_token
        self._given = given  # a set rate, or the first estimate until a load is measured
        self._bytes = {"host": 0, "disk": 0}  # measured loads since start
        self._seconds = {"host": 0.0, "disk": 0.0}

    # -- measurements -----------------------------------------------------------------------------------------
    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A probe's prefill of `tokens` tokens took `seconds` (ignored with fixed rates)."""
        if tokens > 0 and not self.fixed:
            with self._lock:
                self._prefill = seconds / tokens

    def measured(self, tier: str, total_bytes: int, total_seconds: float) -> None:
        """Every load from `tier` since start ("host": copies into pages; "disk": file reads): their bytes and
        seconds, summed (ignored with fixed rates)."""
        if not self.fixed and tier in self._bytes:
            with self._lock:
                self._bytes[tier], self._seconds[tier] = total_bytes, total_seconds

    def s_per_byte(self, tier: str) -> float | None:
        with self._lock:
            if not self.fixed and self._bytes.get(tier, 0) >= MIN_MEASURED_BYTES:
                return self._seconds[tier] / self._bytes[tier]
            return self._given.get(tier)

    @property
    def prefill_s_per_token(self) -> float | None:
        with self._lock:
            return self._prefill

    # -- the decision ------------------------------------------------------------------------------------------
    def load_s(self, tier: str, nbytes: int) -> float | None:
        """Estimated seconds to bring `nbytes` from `tier` into pages (a disk load is a read, then the copy)."""
        if tier == "pool":
            return 0.0
        legs = ("host",) if tier == "host" else ("disk", "host")
        rates = [self.s_per_byte(leg) for leg in legs]
        if rates[0] is None:
            return None
        return nbytes * sum(r for r in rates if r is not None)

    def decide(self, tier: str | None, nbytes: int, tokens: int) -> Decision:
        """Load unless a measured load of the block (`nbytes` in `tier`) costs more than prefilling its
        `tokens`, by `min_gain_s` at least: a tier not measured yet is loaded (that load measures it), and so
        is the pool (no copy)."""
        if tier is None:
            return Decision(None, None, None, None)
        load = self.load_s(tier, nbytes)
        prefill = self.prefill_s_per_token
        recompute = None if prefill is None else prefill * tokens
        slower = load is not None and recompute is not None and load - recompute > self.min_gain_s
        path = "recompute" if slower else "load"
        return Decision(tier, path, load, recompute)

    def snapshot(self) -> dict:
        """The rates now (/metrics): seconds per byte by tier (None: not measured), seconds per token."""
        return {
            "load_s_per_byte": {tier: self.s_per_byte(tier) for tier in ("host", "disk")},
            "prefill_s_per_token": self.prefill_s_per_token,
        }

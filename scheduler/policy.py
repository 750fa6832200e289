"""Pure policy: heat statistics + caps -> which memories form a user's block, which blocks leave under the
overall byte cap, which memories are distill candidates.

Each promotion strategy is a tiny class returning a score (higher = hotter); strategies are chosen by name.
Nothing here reads a clock, a store or a queue: `now` and the statistics are arguments.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from scheduler.heat import HeatStats


class PromotionPolicy:
    name = "base"

    def score(self, stats: HeatStats, now: float, half_life_s: float) -> float:
        raise NotImplementedError


class HeatPromotion(PromotionPolicy):
    """Exponentially decayed hits and uses (recent and frequent both count)."""

    name = "heat"

    def score(self, stats: HeatStats, now: float, half_life_s: float) -> float:
        return stats.score_now(now, half_life_s)


class LRUPromotion(PromotionPolicy):
    """Most recently accessed first (never-accessed memories by when they were added)."""

    name = "lru"

    def score(self, stats: HeatStats, now: float, half_life_s: float) -> float:
        return stats.last_access if stats.last_access is not None else stats.first_seen - 1e12


class LFUPromotion(PromotionPolicy):
    """Most accessed first, all time; ties by recency."""

    name = "lfu"

    def score(self, stats: HeatStats, now: float, half_life_s: float) -> float:
        return stats.hits + stats.uses + 1e-12 * (stats.last_access or 0.0)


_POLICIES: dict[str, type[PromotionPolicy]] = {p.name: p for p in (HeatPromotion, LRUPromotion, LFUPromotion)}


def promotion_policy(name: str) -> PromotionPolicy:
    if name not in _POLICIES:
        raise ValueError(f"unknown promotion policy {name!r}; supported: {', '.join(sorted(_POLICIES))}")
    return _POLICIES[name]()


def user_cap_tokens(
    max_tokens: int, max_bytes: int | None, bytes_per_token: float, overhead_tokens: int = 0
) -> int:
    """Memory tokens one user's block may hold: the token cap, and the byte cap less the fixed header (system
    prompt) every block carries. 0 means no block fits."""
    cap = max_tokens
    if max_bytes is not None and bytes_per_token > 0:
        cap = min(cap, int(max_bytes // bytes_per_token) - overhead_tokens)
    return max(cap, 0)


@dataclass(frozen=True)
class Candidate:
    memory_id: str
    score: float
    num_tokens: int
    last_change: float = 0.0  # when the memory was written or last changed (its block position: see _fill)


@dataclass(frozen=True)
class BlockDecision:
    """`action`: keep (nothing to do), append (current block + new ids), rebuild (reordered), drop (no block)."""

    memory_ids: tuple[str, ...]
    action: str
    value: float  # tokens the chosen memories are expected to serve: sum of score x num_tokens


def _value(chosen: Sequence[Candidate]) -> float:
    """What a block is worth: a memory served from KV saves its tokens on every hit, so its score counts once
    per token (a hot 100-token memory is worth more than an equally hot 10-token one)."""
    return sum(c.score * c.num_tokens for c in chosen)


def _fill(order: Sequence[Candidate], start: Sequence[Candidate], cap_tokens: int) -> list[Candidate]:
    """`start`, then the hottest of the rest (`order`) that fit, laid out after it longest unchanged first: a
    change of a memory costs the block everything after it (scheduler/invalidate.py cuts it there), and the
    memory just written or changed is the likeliest to change next (a changed memory is also the hottest, so
    heat order would put it first, where its next change costs the whole block)."""
    chosen, used = [], sum(c.num_tokens for c in start)
    taken = {c.memory_id for c in start}
    for c in order:
        if c.memory_id not in taken and c.score > 0 and used + c.num_tokens <= cap_tokens:
            chosen.append(c)
            taken.add(c.memory_id)
            used += c.num_tokens
    return [*start, *sorted(chosen, key=lambda c: (c.last_change, c.memory_id))]


def choose_block(
    candidates: Sequence[Candidate], current: Sequence[str], cap_tokens: int, hysteresis: float
) -> BlockDecision:
    """The block for one user.

    The ideal block is the hottest memories that fit the cap. Changing the stored block costs a prefill of
    everything after the part that is kept, so: new hot memories are appended when they fit (the stored block
    stays a valid prefix: "append"); otherwise the block is cut after its longest prefix of still-ideal
    memories and refilled from the hottest ("truncate", or "rebuild" when nothing is kept) -- but only when that
    is worth more than `hysteresis` times the appended block (worth: expected tokens served, `_value`), so
    plans do not thrash. A current block holding a memory that is no longer a candidate (deleted) is cut
    before it. What is added after the kept part is laid out longest unchanged first (`_fill`).
    """
    by_id = {c.memory_id: c for c in candidates}
    order = sorted(candidates, key=lambda c: (-c.score, c.memory_id))
    ideal = _fill(order, [], cap_tokens)
    ideal_ids = {c.memory_id for c in ideal}
    valid = 0
    while valid < len(current) and current[valid] in by_id:
        valid += 1
    kept = [by_id[m] for m in current[:valid]]
    if valid == len(current) and current and sum(c.num_tokens for c in kept) <= cap_tokens:
        appended = _fill(order, kept, cap_tokens)
        value_appended = _value(appended)
    else:
        appended, value_appended = [], -1.0
    prefix = 0
    while prefix < len(kept) and kept[prefix].memory_id in ideal_ids:
        prefix += 1
    refilled = _fill(order, kept[:prefix], cap_tokens)
    value_refilled = _value(refilled)
    if value_appended >= 0 and value_refilled <= hysteresis * value_appended:
        ids = tuple(c.memory_id for c in appended)
        return BlockDecision(ids, "keep" if ids == tuple(current) else "append", value_appended)
    if not refilled:
        return BlockDecision((), "drop" if current else "keep", 0.0)
    ids = tuple(c.memory_id for c in refilled)
    if ids == tuple(current):
        return BlockDecision(ids, "keep", value_refilled)
    return BlockDecision(ids, "truncate" if prefix else "rebuild", value_refilled)


@dataclass(frozen=True)
class BlockUsage:
    user_id: str
    num_bytes: int
    value: float  # tokens the block is expected to serve now: sum of heat x tokens
    last_access: float


def blocks_to_evict(blocks: Sequence[BlockUsage], total_cap_bytes: int | None) -> list[str]:
    """Users whose blocks leave so the rest fit: least valuable per byte first, then least recently used."""
    if total_cap_bytes is None:
        return []
    total = sum(b.num_bytes for b in blocks)
    out = []
    for b in sorted(blocks, key=lambda b: (b.value / max(b.num_bytes, 1), b.last_access, b.user_id)):
        if total <= total_cap_bytes:
            break
        out.append(b.user_id)
        total -= b.num_bytes
    return out


def distill_candidates(
    stats: Mapping[str, HeatStats], now: float, *, min_uses: int, min_stable_s: float
) -> list[str]:
    """Memories used often and unchanged for long: candidates for the LoRA tier (a later job distils them)."""
    return sorted(m for m, s in stats.items() if s.uses >= min_uses and s.stable_for_s(now) >= min_stable_s)

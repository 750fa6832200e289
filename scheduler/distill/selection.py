"""Which of a user's memories go into their next adapter: a pure policy over memories, their heat and the clock.

A memory is chosen when it states a fact the distiller can phrase and check (data.parse_fact), has
been stable (not created or changed) for `min_stable_s`, was used at least `min_uses` times, and no other
memory of the user about the same thing changed recently or says otherwise (a contradiction: both stay
KV/text until one is deleted or has been stable for long). Hottest first, at most `max_facts`. `every=True`
(the CLI's --all) drops the stability and use requirements, not the others. No I/O: inputs in, choice out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from scheduler.distill.data import Fact, fact_key, parse_fact
from scheduler.heat import HeatStats


@dataclass(frozen=True)
class SelectConfig:
    min_stable_s: float = 7 * 24 * 3600.0  # unchanged this long (since created or last updated)
    min_uses: int = 5  # used in at least this many answers
    max_facts: int = 50  # per adapter
    half_life_s: float = 3600.0  # for ordering by heat

    def __post_init__(self) -> None:
        if self.max_facts < 1:
            raise ValueError(f"SelectConfig.max_facts must be >= 1, got {self.max_facts!r}")
        for name in ("min_stable_s", "min_uses"):
            if getattr(self, name) < 0:
                raise ValueError(f"SelectConfig.{name} must be >= 0, got {getattr(self, name)!r}")
        if self.half_life_s <= 0:
            raise ValueError(f"SelectConfig.half_life_s must be > 0, got {self.half_life_s!r}")


@dataclass(frozen=True)
class MemoryInfo:
    """What the policy needs of a memory: id, version, text and when it last changed (seconds)."""

    memory_id: str
    version: int
    text: str
    changed_at: float  # created_at for version 1, updated_at after an update


@dataclass(frozen=True)
class Selection:
    facts: tuple[Fact, ...]  # chosen, hottest first
    skipped: tuple[tuple[str, str], ...]  # (memory id, why), in memory order


def select_facts(
    memories: Sequence[MemoryInfo],
    stats: Mapping[str, HeatStats],
    now: float,
    config: SelectConfig,
    *,
    every: bool = False,
) -> Selection:
    parsed: dict[str, Fact] = {}
    skipped: list[tuple[str, str]] = []
    for m in memories:
        fact = parse_fact(m.memory_id, m.version, m.text)
        if fact is None:
            skipped.append((m.memory_id, "not a fact the distiller can phrase"))
        else:
            parsed[m.memory_id] = fact
    changed = {m.memory_id: m.changed_at for m in memories}
    by_key: dict[tuple[str, str], list[Fact]] = {}
    for f in parsed.values():
        by_key.setdefault(fact_key(f), []).append(f)
    eligible: list[Fact] = []
    for m in memories:
        fact = parsed.get(m.memory_id)
        if fact is None:
            continue
        s = stats.get(m.memory_id)
        last_change = max(m.changed_at, s.last_change if s is not None else m.changed_at)
        same = [o for o in by_key[fact_key(fact)] if o.memory_id != fact.memory_id]
        if any(o.answer.lower() != fact.answer.lower() for o in same):
            skipped.append((m.memory_id, "contradicted by another memory"))
        elif any(now - changed[o.memory_id] < config.min_stable_s for o in same):
            skipped.append((m.memory_id, "a memory about the same thing changed recently"))
        elif not every and now - last_change < config.min_stable_s:
            skipped.append((m.memory_id, "changed recently"))
        elif not every and (s is None or s.uses < config.min_uses):
            skipped.append((m.memory_id, "not used often enough"))
        else:
            eligible.append(fact)
    # duplicates (same key and answer) keep one memory: the oldest id order is stable
    seen: set[tuple[str, str]] = set()
    unique = []
    for f in eligible:
        if fact_key(f) in seen:
            skipped.append((f.memory_id, "duplicate of another chosen memory"))
            continue
        seen.add(fact_key(f))
        unique.append(f)

    def heat(f: Fact) -> float:
        s = stats.get(f.memory_id)
        return s.score_now(now, config.half_life_s) if s is not None else 0.0

    ranked = sorted(unique, key=lambda f: (-heat(f), f.memory_id))
    for f in ranked[config.max_facts :]:
        skipped.append((f.memory_id, f"over the cap of {config.max_facts} facts"))
    return Selection(tuple(ranked[: config.max_facts]), tuple(skipped))

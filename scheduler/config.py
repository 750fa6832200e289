"""SchedulerConfig: every knob of the scheduler, validated once where it is built.

Knows the shape of the settings only; what they mean is in heat.py and policy.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.policy import promotion_policy, user_cap_tokens


@dataclass(frozen=True)
class SchedulerConfig:
    half_life_s: float = 3600.0  # heat halves every hour without access
    use_weight: float = 2.0  # a memory used in an answer counts this many retrieval hits
    recency_prior: float = 0.25  # heat a memory has when added, decaying like any other heat
    user_block_tokens: int = 2048  # per-user cap on block tokens
    user_block_bytes: int | None = None  # per-user cap on block bytes (None: only the token cap)
    total_block_bytes: int | None = None  # cap over every user's block (None: unlimited)
    bytes_per_token: int = 46080  # K+V bytes per token (SmolLM2-135M fp32); set from the model when known
    hysteresis: float = 1.5  # rebuild (reorder) only when the ideal block is worth this many times more
    promotion: str = "heat"
    distill_min_uses: int = 5  # memories used this often ...
    distill_min_stable_s: float = 7 * 24 * 3600.0  # ... and unchanged this long become distill candidates
    max_plans: int = 1000  # users whose plans stay in memory (least recently used dropped; rebuilt on return)
    max_queued_tasks: int = 10_000  # in-process queue entries (one per user's work); past that new ones drop

    def __post_init__(self) -> None:
        for name in ("half_life_s", "hysteresis", "max_plans", "max_queued_tasks"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SchedulerConfig.{name} must be > 0, got {getattr(self, name)!r}")
        if self.hysteresis < 1:
            raise ValueError(f"SchedulerConfig.hysteresis must be >= 1, got {self.hysteresis!r}")
        for name in (
            "use_weight",
            "recency_prior",
            "user_block_tokens",
            "bytes_per_token",
            "distill_min_uses",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"SchedulerConfig.{name} must be >= 0, got {getattr(self, name)!r}")
        for name in ("user_block_bytes", "total_block_bytes"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"SchedulerConfig.{name} must be >= 0 or None, got {value!r}")
        promotion_policy(self.promotion)  # raises naming the supported policies

    @property
    def user_cap_tokens(self) -> int:
        """Memory tokens per user before any block was built (the worker then learns the block header)."""
        return user_cap_tokens(self.user_block_tokens, self.user_block_bytes, self.bytes_per_token)

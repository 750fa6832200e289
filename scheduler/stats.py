"""What the scheduler reports about itself: blocks, plan reads and hits, the queue, the worker's tasks and builds.

Owns the record only (SchedulerStats); the facade (service.py) fills it in from its parts. Knows nothing of
how any figure is computed or served.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerStats:
    num_blocks: int  # activation tier: users with a published block ...
    block_memories: int  # ... the memories those blocks hold ...
    block_tokens: int
    block_bytes: int
    tracked_memories: int  # plaintext tier: memories the scheduler has heat for
    plan_reads: int
    plan_hits: int  # reads that found a block
    queue_depth: int
    tasks_done: int
    task_p50_s: float
    task_p99_s: float
    task_max_s: float
    builds: int  # blocks the worker asked for (a stored one found again counts too) ...
    prefills: int  # ... and those of them that were prefilled
    discarded_builds: int
    distill_candidates: int
    dropped_tasks: int = 0  # tasks and access events the bounded in-process queue dropped (queue.py)
    cuts: int = 0  # blocks cut before a changed memory: the memories before it kept as KV, no prefill

    @property
    def hit_rate(self) -> float:
        return self.plan_hits / self.plan_reads if self.plan_reads else 0.0

"""scheduler: decides which memories live in which tier; imports kvmem, never serving.

heat.py (statistics), accounting.py (a served turn -> an access event), policy.py (pure choices), plan.py
(atomic snapshots), queue.py (tasks), block_maker.py (what blocks are built through), worker.py (runs them),
service.py (the Scheduler facade).
"""

from scheduler.accounting import turn_access
from scheduler.block_maker import BlockMaker
from scheduler.config import SchedulerConfig
from scheduler.heat import AccessEvent
from scheduler.plan import BlockPlan, Plan, PlanBook
from scheduler.service import Scheduler, SchedulerStats

__all__ = [
    "AccessEvent",
    "BlockMaker",
    "BlockPlan",
    "Plan",
    "PlanBook",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerStats",
    "turn_access",
]

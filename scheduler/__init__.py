"""scheduler: decides which memories live in which tier; imports kvmem, never serving.

heat.py (statistics), policy.py (pure choices), plan.py (atomic snapshots), queue.py, service.py (the worker).
"""

from scheduler.config import SchedulerConfig
from scheduler.plan import BlockPlan, Plan, PlanBook
from scheduler.service import AccessEvent, Scheduler, SchedulerStats

__all__ = ["AccessEvent", "BlockPlan", "Plan", "PlanBook", "Scheduler", "SchedulerConfig", "SchedulerStats"]

"""The plan book's bound: at most `max_users` users' plans in memory, the least recently read or published
dropped first; the Scheduler asks again for a dropped user's plan on their next read."""

from __future__ import annotations

from scheduler import Scheduler, SchedulerConfig
from scheduler.plan import BlockPlan, Plan, PlanBook
from tests.scheduler.test_scheduler import FakeBuilder
from tests.scheduler.test_scheduler import env as env  # noqa: F401 - a fixture


def plan(user_id: str) -> Plan:
    return Plan(user_id, BlockPlan(f"item-{user_id}", (f"m-{user_id}",), ("t",), 10, 40), version=1)


def test_past_max_users_the_least_recently_used_plan_is_dropped() -> None:
    book = PlanBook(max_users=3)
    for user in ("a", "b", "c", "d"):  # N + 1 users published
        book.publish(plan(user))
    assert book.users() == ["b", "c", "d"] and "a" not in book  # exactly N remain, the oldest gone
    assert book.get("a") == Plan("a")  # dropped: an empty plan, like a user never seen
    assert book.get("b") == plan("b")  # a read makes b the most recent ...
    book.publish(plan("e"))
    assert book.users() == ["d", "b", "e"]  # ... so c, least recently used, goes next
    assert book.register("f") and not book.register("f") and not book.register("e")
    assert book.users() == ["b", "e", "f"] and book.get("e") == plan("e")  # register keeps a held plan


class EmptySource:
    def list(self, user_id, *, session_id=None, page=1, page_size=20):
        from kvmem.text import Page

        return Page(items=[], page=page, page_size=page_size, total=0)

    def subscribe(self, callback):
        return lambda: None


def test_the_users_asked_for_are_the_bounded_book_and_a_dropped_one_is_asked_for_again() -> None:
    sched = Scheduler(SchedulerConfig(max_plans=2), EmptySource(), FakeBuilder(), len, clock=lambda: 0.0)

    def drain() -> list[tuple[str, str]]:
        return [(t.kind, t.user_id) for t in iter(lambda: sched.queue.get(timeout_s=0), None)]

    for user in ("u0", "u1", "u2"):  # N + 1 unknown users read their plans
        assert sched.get(user) == Plan(user)
    assert sched.plans.users() == ["u1", "u2"]  # exactly N known, the oldest forgotten
    assert drain() == [("refresh", "u0"), ("refresh", "u1"), ("refresh", "u2")]
    sched.get("u1")
    sched.get("u2")
    assert drain() == []  # still known: asked for once
    sched.get("u0")
    assert drain() == [("refresh", "u0")]  # forgotten, so asked for again
    assert sched.plans.users() == ["u2", "u0"]
    sched.stop()


def test_per_user_state_beside_the_book_is_dropped_with_the_users_plan(env) -> None:
    clock, store, builder, make = env
    sched = make(max_plans=2)
    for user in ("u0", "u1", "u2"):  # N + 1 users, each with a memory and a built block
        store.add(user, text=f"{user} keeps bees on the roof")
        sched.get(user)
        sched.run_pending()
    assert sched.plans.users() == ["u1", "u2"]
    worker = sched.worker
    assert sorted(worker._token_counts) == ["u1", "u2"]  # u0's token counts went with its plan
    assert sorted(worker.distill) == ["u1", "u2"]
    assert sorted(worker.guard._stamps) == ["u1", "u2"]
    sched.get("u0")  # asked for again: rebuilt (found by its content address), its state with it
    sched.run_pending()
    assert sched.plans.users() == ["u2", "u0"]
    assert sorted(worker._token_counts) == ["u0", "u2"] and sorted(worker.distill) == ["u0", "u2"]
    sched.stop()

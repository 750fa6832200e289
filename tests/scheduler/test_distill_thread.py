"""The background distillation runner: one job at a time, off the caller's thread, at the lowest OS priority
with one torch thread, a user never queued twice, a failing job logged and recorded as None."""

from __future__ import annotations

import os
import threading

import torch

from scheduler.distill.job import DistillThread


def test_jobs_run_one_at_a_time_at_low_priority_with_one_torch_thread():
    release = threading.Event()
    seen: list[tuple[str, str, int, int]] = []

    def job(user: str):
        release.wait(10)
        tid = threading.get_native_id()
        seen.append(
            (
                user,
                threading.current_thread().name,
                os.getpriority(os.PRIO_PROCESS, tid),
                torch.get_num_threads(),
            )
        )
        if user == "bad":
            raise RuntimeError("training failed")
        return None

    runner = DistillThread(job)
    try:
        assert runner.submit("alice")
        assert runner.submit("bob")
        assert not runner.submit("bob")  # already queued
        assert runner.submit("bad")
        assert not runner.idle()
        release.set()
        assert runner.wait_idle(30)
        assert [s[0] for s in seen] == ["alice", "bob", "bad"]
        assert {s[1:] for s in seen} == {("kvmem-distill", 19, 1)}
        assert runner.outcomes == {"alice": None, "bob": None, "bad": None}
        assert threading.current_thread().name != "kvmem-distill"
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) != 19 or os.nice(0) == 19
    finally:
        runner.close()


def test_the_outcomes_kept_are_the_most_recent_users_and_bounded(monkeypatch):
    """One outcome per user was kept forever (an outcome holds its facts' texts)."""
    import scheduler.distill.job as job_module

    monkeypatch.setattr(job_module, "MAX_OUTCOMES", 3)
    runner = DistillThread(lambda user: f"outcome of {user}")
    try:
        for user in ("a", "b", "c", "d", "b"):
            assert runner.submit(user)
            assert runner.wait_idle(30)
        assert list(runner.outcomes.items()) == [
            ("c", "outcome of c"),
            ("d", "outcome of d"),
            ("b", "outcome of b"),
        ]
    finally:
        runner.close()

"""The distillation sweep against a job in progress: it recorded a user's candidates as tried even when the user's
job was running (submit refused them), so what came while it trained (the job trains what it read at its start)
was never distilled: every later sweep skipped the user as tried with exactly these."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import kvmem.kv.layout as layout_mod
import serving.background.distill as bgd
from scheduler.distill.job import DistillConfig


class FakeScheduler:
    def __init__(self):
        self.adapter_stopped = []
        self.candidates = {"alice": ["m1", "m2"]}
        self.plans = SimpleNamespace(users=lambda: ["alice"])
        self.heat = SimpleNamespace(stats=lambda user: {})

    def distill_candidates(self, user):
        return list(self.candidates.get(user, []))

    def served_adapter(self, user):
        return None


def _distiller(tmp_path, monkeypatch, sched) -> bgd.BackgroundDistill:
    """The server's BackgroundDistill over `sched`, its sweep run by hand (the loop's interval is an hour)."""
    monkeypatch.setattr(layout_mod, "PromptLayout", lambda *a, **k: None)
    backend = SimpleNamespace(is_ready=lambda: True, layout=SimpleNamespace(system_prompt=""))
    config = SimpleNamespace(data_dir=tmp_path, distill_interval_s=3600.0, distill_augment="templates")
    return bgd.BackgroundDistill(
        config,
        store=None,
        scheduler=sched,
        backend=backend,
        distill_config=DistillConfig(),
        load_handle=lambda: SimpleNamespace(tokenizer=None),
    )


def test_candidates_that_arrive_while_the_users_job_runs_are_queued_by_the_next_sweep_after_it(
    tmp_path, monkeypatch
):
    started, release = threading.Event(), threading.Event()
    trained: list[frozenset] = []
    sched = FakeScheduler()

    def fake_distill_user(user_id, **kw):
        trained.append(frozenset(sched.distill_candidates(user_id)))  # what this job trains on
        started.set()
        release.wait(10)
        return SimpleNamespace(summary=lambda: {})

    monkeypatch.setattr(bgd, "distill_user", fake_distill_user)
    d = _distiller(tmp_path, monkeypatch, sched)
    try:
        assert d.sweep() == ["alice"]
        assert started.wait(10)
        # a new candidate while alice's job trains {m1, m2}
        sched.candidates["alice"] = ["m1", "m2", "m3"]
        assert d.sweep() == []  # refused: alice's job is running
        release.set()
        assert d.thread.wait_idle(10)
        # alice's job trained {m1, m2} only: m3 still waits; a sweep should queue her again
        assert d.sweep() == ["alice"]
        assert d.thread.wait_idle(10)
        assert trained == [frozenset({"m1", "m2"}), frozenset({"m1", "m2", "m3"})]
        assert d.sweep() == []  # tried with exactly these now: not again until they change
    finally:
        d.close()


def test_the_candidates_remembered_are_the_most_recent_users_and_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(bgd, "MAX_TRIED", 2)
    d = _distiller(tmp_path, monkeypatch, FakeScheduler())
    try:
        for user in ("a", "b", "c", "a"):
            d._set_tried(user, frozenset({user}))
        assert list(d._tried) == ["c", "a"]
    finally:
        d.close()

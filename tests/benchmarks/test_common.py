"""benchmarks.common's shared-machine guard: other processes' CPU share from /proc/stat-style ticks minus this
process's own time, and the retry of a timed run while others' load spoiled it (fakes, no clock)."""

from __future__ import annotations

from benchmarks.common import OthersCpu, run_when_quiet


class Readers:
    def __init__(self, ticks, own_s):
        self.ticks, self.own_s = list(ticks), list(own_s)

    def read_ticks(self):
        return self.ticks.pop(0)

    def read_own_s(self):
        return self.own_s.pop(0)


def test_others_share_is_busy_ticks_minus_own_cpu_over_all_ticks():
    r = Readers(ticks=[(100, 1000), (400, 1400)], own_s=[0.5, 2.0])
    meter = OthersCpu(r.read_ticks, r.read_own_s, ticks_per_s=100)
    meter.start()
    # 300 busy ticks, 150 of them ours (1.5 s at 100 ticks/s), over 400 ticks of all cores
    assert meter.share() == 150 / 400


def test_others_share_is_clamped_and_none_without_proc_stat():
    r = Readers(ticks=[(0, 100), (10, 200), None, (0, 0)], own_s=[0.0, 1.0, 0.0, 0.0])
    meter = OthersCpu(r.read_ticks, r.read_own_s, ticks_per_s=100)
    meter.start()
    assert meter.share() == 0.0  # own time counted past the busy ticks (tick rounding): not negative
    meter.start()
    assert meter.share() is None


class FakeMeter:
    def __init__(self, shares):
        self.shares = list(shares)

    def start(self):
        pass

    def share(self):
        return self.shares.pop(0)


def test_run_when_quiet_runs_again_while_others_took_too_much():
    calls, waits = [], []
    run = run_when_quiet(
        lambda: calls.append(len(calls)) or len(calls),
        max_share=0.1,
        attempts=3,
        max_wait_s=60,
        meter=FakeMeter([0.5, 0.05]),
        wait=lambda share, max_s: waits.append((share, max_s)) or 2.0,
    )
    assert run == (2, 0.05, 2, 4.0)
    assert waits == [(0.1, 60), (0.1, 60)]


def test_run_when_quiet_keeps_the_last_run_after_all_attempts():
    run = run_when_quiet(
        lambda: "r",
        max_share=0.1,
        attempts=2,
        max_wait_s=1,
        meter=FakeMeter([0.5, 0.4]),
        wait=lambda share, max_s: 0.0,
    )
    assert run == ("r", 0.4, 2, 0.0)


def test_run_when_quiet_without_a_limit_runs_once_and_never_waits():
    run = run_when_quiet(
        lambda: "r",
        max_share=None,
        attempts=3,
        max_wait_s=1,
        meter=FakeMeter([0.9]),
        wait=lambda share, max_s: 1 / 0,
    )
    assert run == ("r", 0.9, 1, 0.0)

"""The scheduler simulation runs on a tiny trace; with a one-request window the clairvoyant optimum is a
true upper bound (it picks the best block for each request), so no policy may beat it."""

from __future__ import annotations

import json

from benchmarks.tiers import sched_sim


def test_sched_sim_quick(tmp_path, capsys):
    out = tmp_path / "s.json"
    result = sched_sim.main(["--quick", "--window", "1", "--out", str(out)])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == json.loads(out.read_text())
    shares = {p["policy"]: p["served_share"] for p in result["policies"]}
    assert set(shares) == {"optimum", "ours", "lru", "lfu"}
    assert all(0.0 < v <= shares["optimum"] <= 1.0 for v in shares.values())
    assert all(p["prefill_tokens_per_request"] > 0 for p in result["policies"])
    assert result["request_path"]["iterations"] == 2000 and result["request_path"]["p99_us"] > 0


def test_trace_is_deterministic_and_shifts_topic():
    a = sched_sim.make_trace(3, num_requests=20, per_topic=8, k=3, zipf_s=1.1, p_topic=1.0)
    b = sched_sim.make_trace(3, num_requests=20, per_topic=8, k=3, zipf_s=1.1, p_topic=1.0)
    assert a == b and a.shift_at == 10
    assert all(m.startswith("buying a home:") for q in a.requests[:10] for m in q)
    assert all(m.startswith("renovating:") for q in a.requests[10:] for m in q)


def test_ours_is_the_real_scheduler_fed_by_the_servers_accounting(monkeypatch):
    """ "ours" is not a model of the scheduler: each request is recorded through the server's own accounting
    (scheduler.turn_access) into a real Scheduler, whose published plan serves the next request."""
    calls, reads = [], []
    real_access, real_get = sched_sim.turn_access, sched_sim.Scheduler.get

    def access(*args, **kw):
        calls.append((args, kw))
        return real_access(*args, **kw)

    def get(self, user_id):
        plan = real_get(self, user_id)
        reads.append(plan.block.memory_ids if plan.block else ())
        return plan

    monkeypatch.setattr(sched_sim, "turn_access", access)
    monkeypatch.setattr(sched_sim.Scheduler, "get", get)
    trace = sched_sim.make_trace(3, num_requests=12, per_topic=8, k=3, zipf_s=1.1, p_topic=1.0)
    out, rebuilds, appends, prefilled = sched_sim.replay(
        "ours", trace, 150, window=6, half_life_s=600.0, hysteresis=1.02
    )
    assert calls == [(("u", req), {"at": 60.0 * (r + 1)}) for r, req in enumerate(trace.requests)]
    served_by_plan = [
        sum(trace.sizes[m] for m in req if m in set(block))
        for req, block in zip(trace.requests, reads, strict=True)
    ]
    assert [s for s, _ in out] == served_by_plan and served_by_plan[0] == 0  # nothing built before request 0
    assert (rebuilds, appends, prefilled) == (2, 1, 361)

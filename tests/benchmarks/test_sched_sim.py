"""The scheduler simulation runs on a tiny trace; with a one-request window the clairvoyant optimum is a
true upper bound (it picks the best block for each request), so no policy may beat it."""

from __future__ import annotations

import json

from benchmarks import sched_sim


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

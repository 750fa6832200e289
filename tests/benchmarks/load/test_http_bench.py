"""The HTTP benchmarks run end to end against spawned servers on the fake backend (plumbing, not timing):
well-formed JSON, the KV arm is served from KV, the text arm carries the same memories as text."""

from __future__ import annotations

import json

import pytest

from benchmarks.load import http_load
from benchmarks.ttft import http_ttft


def test_http_ttft_arms(tmp_path, capsys):
    out = tmp_path / "h.json"
    result = http_ttft.main(
        ["--spawn", "--backend", "fake", "--quick", "--memories", "3", "--words", "20", "--out", str(out)]
    )
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == json.loads(out.read_text())
    arms = {(a["arm"], a["concurrency"]): a for a in result["arms"]}
    assert set(arms) == {(arm, c) for arm in ("kv", "text", "none") for c in (1, 4, 8)}
    for c in (1, 4, 8):
        kv, text, none = arms[("kv", c)], arms[("text", c)], arms[("none", c)]
        assert (kv["errors"], text["errors"], none["errors"]) == (0, 0, 0)
        # --quick: max(1, 4 // c) requests per client, so at least 4 samples at every level
        assert kv["num_requests"] == text["num_requests"] == none["num_requests"] == c * max(1, 4 // c)
        assert all(isinstance(arm["server_ttft_mean_s"], float) for arm in (kv, text, none))
        assert all(0 < arm["server_prefill_mean_s"] <= arm["server_ttft_mean_s"] for arm in (kv, text, none))
        assert kv["cached_tokens"] > 0 and text["cached_tokens"] == 0 and none["cached_tokens"] == 0
        # same memories and query: the text prompt holds them all, so it is at least as long as the block
        assert text["prompt_tokens"] >= kv["cached_tokens"] and none["prompt_tokens"] < kv["cached_tokens"]
        # the same query and the same memory texts on both arms; the server used all 3, as KV or as text
        assert kv["query"] == text["query"] == none["query"] == http_ttft.QUERY
        assert kv["memories_sha256"] == text["memories_sha256"] != "" and none["memories_sha256"] == ""
        assert kv["memory_tiers"] == {"kv": 3} and text["memory_tiers"] == {"text": 3}
        assert not none["memory_tiers"]
    assert set(result["summary"]["kv_vs_text_x"]) == {"1", "4", "8"}
    assert all(a["backend"] == "fake" and a["ttft_p50_s"] <= a["ttft_p99_s"] for a in result["arms"])
    assert all(a["tokens_per_s"] > 0 for a in result["arms"])
    cut = result["summary"]["kv_cut_vs_text_pct"]
    assert cut == {
        str(c): 100 * (1 - arms[("kv", c)]["ttft_p50_s"] / arms[("text", c)]["ttft_p50_s"]) for c in (1, 4, 8)
    }
    assert result["summary"]["by_backend"]["fake"]["kv_cut_vs_text_pct"] == cut
    assert "in_process" not in result["summary"]  # fake backend: no in-process baseline
    assert isinstance(result["summary"]["http_client_overhead_ms"], float)


def test_http_ttft_rejects_text_url_alone(tmp_path):

    with pytest.raises(SystemExit) as exc:
        http_ttft.main(["--text-base-url", "http://127.0.0.1:1", "--out", str(tmp_path / "x.json")])
    assert exc.value.code == 2


def test_http_load_runs_without_errors(tmp_path):
    result = http_load.main(
        [
            "--spawn",
            "--backend",
            "fake",
            "--clients",
            "3",
            "--duration-s",
            "2",
            "--words",
            "10",
            "--out",
            str(tmp_path / "l.json"),
        ]
    )
    load = result["load"]
    assert load["num_errors"] == 0 and load["completed"] > 0 and load["output_tokens"] > 0
    assert result["runs"] == [load] and load["backend"] == "fake" and load["clients"] == 3
    env = result["env"]  # the servers' device (kvmem serve's auto: no --device given), not the clients'
    assert env["device"] == "auto" and env["serve_args"] == "" and len(env["loadavg_start"]) == 3


def test_http_load_runs_every_level_against_one_server_per_backend(tmp_path):
    out = tmp_path / "l.json"
    args = ["--spawn", "--backends", "fake", "--levels", "1", "2", "5", "--duration-s", "1"]
    args += ["--serve-args", "--device cpu"]
    result = http_load.main([*args, "--words", "10", "--max-tokens", "3", "--out", str(out)])
    assert json.loads(out.read_text()) == result and "load" not in result  # several runs: no single row
    assert result["env"]["device"] == "cpu" and result["env"]["serve_args"] == "--device cpu"
    assert [(r["backend"], r["clients"]) for r in result["runs"]] == [("fake", 1), ("fake", 2), ("fake", 5)]
    for row in result["runs"]:
        assert row["num_errors"] == 0 and row["completed"] > 0
        # every request streams --max-tokens tokens (the fake backend never stops early)
        assert row["output_tokens"] == 3 * row["completed"]
        assert row["tokens_per_s"] == row["output_tokens"] / row["duration_s"]
        assert row["ttft_p50_s"] <= row["ttft_p99_s"] and row["kv_ttft_p50_s"] <= row["kv_ttft_p99_s"]
        share = row["others_cpu_share"]  # None: a run shorter than one clock tick of /proc/stat
        assert (share is None or 0.0 <= share <= 1.0) and len(row["load_avg_1m"]) == 2
    one = result["runs"][0]  # one client: the KV user's, so both medians are the same requests'
    assert one["kv_ttft_p50_s"] == one["ttft_p50_s"]
    summary = result["summary"]["fake"]
    assert set(summary["tokens_per_s"]) == {"1", "2", "5"}
    assert "kv_ttft_p50_8_over_1_x" not in summary  # no level 8 measured


@pytest.mark.parametrize(
    "bad",
    [
        ["--backends", "fake", "fake"],  # twice
        ["--backends", "fake", "transformers", "--base-url", "http://127.0.0.1:1"],  # several need --spawn
        ["--backends", "tgi"],  # unknown
        ["--spawn", "--levels", "0"],
    ],
)
def test_http_load_rejects_bad_backends_and_levels(tmp_path, bad):
    with pytest.raises(SystemExit) as exc:
        http_load.main([*bad, "--out", str(tmp_path / "x.json")])
    assert exc.value.code == 2
    assert not (tmp_path / "x.json").exists()


@pytest.mark.parametrize(
    "bad",
    [
        ["--backends", "fake", "fake"],
        ["--backends", "fake", "transformers", "--base-url", "http://127.0.0.1:1"],
        ["--levels", "4", "0"],
    ],
)
def test_http_ttft_rejects_bad_backends_and_levels(tmp_path, bad):
    with pytest.raises(SystemExit) as exc:
        http_ttft.main([*bad, "--out", str(tmp_path / "x.json")])
    assert exc.value.code == 2


@pytest.mark.slow
def test_http_ttft_in_process_baseline_splits_the_difference(default_model_dir, tmp_path):
    # the real model behind the server: the in-process prompt is the server's, and the HTTP - in-process
    # difference is split into its three parts (each a median over the same pairs)
    args = ["--spawn", "--memories", "2", "--words", "20", "--levels", "1", "--pairs", "2"]
    result = http_ttft.main([*args, "--requests", "1", "--out", str(tmp_path / "h.json")])
    inproc = result["summary"]["in_process"]
    assert inproc["same_prompt_tokens"] is True and inproc["pairs"] == 2
    assert inproc["block_tokens"] == result["summary"]["block_tokens"] > 0
    parts = ("http_client_ms", "server_before_backend_ms", "prefill_minus_inprocess_ms")
    assert all(isinstance(inproc[p], float) for p in parts)
    assert inproc["http_client_ms"] > 0 and inproc["server_before_backend_ms"] > 0

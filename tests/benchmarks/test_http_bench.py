"""The HTTP benchmarks run end to end against spawned servers on the fake backend (plumbing, not timing):
well-formed JSON, the KV arm is served from KV, the text arm carries the same memories as text."""

from __future__ import annotations

import json

import pytest

from benchmarks import http_load, http_ttft


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

"""benchmarks/gpu/graph_tokens.py, the GPU suite's check of CUDA graphs' greedy tokens against eager steps: on
CPU (nothing captured: the static steps run eagerly) it runs the workload in both dtypes and writes its JSON;
a divergence passes only at a near-tie of the eager step; the suite runs it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from kvmem.kv.sampling import TokenLogprobs

ROOT = Path(__file__).resolve().parents[3]


def test_the_check_runs_on_cpu_and_writes_its_json(tiny_model_dir, tmp_path):
    from benchmarks.gpu import graph_tokens

    out = tmp_path / "graph_tokens.json"
    result = graph_tokens.main(
        ["--model", str(tiny_model_dir), "--device", "cpu", "--smoke", "--out", str(out)]
    )
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert result["pass"] and [r["dtype"] for r in result["runs"]] == ["float32", "bfloat16"]
    for run in result["runs"]:
        assert run["identical"] == run["requests"] == 3 and run["diverged"] == []
        assert run["static_steps"] > 0 and run["graph_replays"] == 0 and run["failed_buckets"] == []
        # every reachable bucket at load: up to 16 rows (--max-rows), contexts up to the tiny llama's 8,192
        # positions (its pages of 16 tokens in 64 MiB hold more): 5 row counts x 5 contexts
        assert run["buckets_captured_at_load"] == len(run["buckets"]) == 25


def test_a_divergence_is_reported_with_the_eager_steps_gap():
    from benchmarks.gpu.graph_tokens import divergence

    lps = [TokenLogprobs(5, -0.1, ((5, -0.1), (7, -0.12))), TokenLogprobs(9, -0.5, ((9, -0.5), (3, -2.0)))]
    assert divergence([5, 9], lps, [5, 9]) is None
    d = divergence([5, 9], lps, [7, 1])
    assert d["at"] == 0 and abs(d["gap_nats"] - 0.02) < 1e-9  # a near-tie
    assert divergence([5, 9], lps, [5, 4]) == {"at": 1, "gap_nats": None}  # not among the eager top ones


def test_the_gpu_suite_runs_the_check():
    suite = ROOT / "benchmarks" / "gpu" / "gpu_suite.sh"
    assert subprocess.run(["bash", "-n", str(suite)], check=False).returncode == 0
    assert "step graph_tokens" in suite.read_text() and "-m benchmarks.gpu.graph_tokens" in suite.read_text()

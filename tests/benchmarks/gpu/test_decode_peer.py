"""benchmarks/gpu/decode_peer.py on CPU with a tiny Qwen3 shape (the script's smoke, not figures): the engine and
transformers' continuous batching decode the same prompts to the same greedy tokens (float32), every case has
its floor column, and the GPU suite runs the script."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from benchmarks.gpu import decode_peer

ROOT = Path(__file__).resolve().parents[3]


def test_the_tiny_smoke_runs_both_and_they_agree(tmp_path, capsys):
    out = tmp_path / "d.json"
    result = decode_peer.main(
        [
            "--tiny",
            "--device",
            "cpu",
            "--rows",
            "1",
            "3",
            "--prompt",
            "20",
            "--new-tokens",
            "4",
            "--out",
            str(out),
        ]
    )
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == json.loads(out.read_text())
    assert result["env"]["git_sha"] and result["attn_implementation_requested"] == "paged|sdpa"
    cases = {(c["kind"], c["rows"]): c for c in result["cases"]}
    assert sorted(cases) == [("engine", 1), ("engine", 3), ("peer", 1), ("peer", 3)]
    for (kind, rows), case in cases.items():
        assert case["tokens"] == rows * 4
        assert case["floor"]["card"] is None and case["floor"]["floor_s"] is None  # a CPU: no card
        assert case["floor"]["bytes"] > result["weight_bytes"] and case["floor"]["flops"] > 0
        if kind == "engine":
            assert case["replies_equal_to_peer"] == rows
    assert [r["rows"] for r in result["side_by_side"]] == [1, 3]


def test_the_gpu_suite_runs_it():
    suite = (ROOT / "benchmarks" / "gpu" / "gpu_suite.sh").read_text()
    assert subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / "gpu" / "gpu_suite.sh")]).returncode == 0
    assert "step decode_qwen3_8b" in suite and "-m benchmarks.gpu.decode_peer" in suite
    assert "DP=(--tiny" in suite  # SMOKE=1: the tiny shape
    # the compiled element-wise functions measured beside the eager ones, no peer (issue 43 item 2)
    assert 'step decode_qwen3_8b_compiled 150 "$PY" -m benchmarks.gpu.decode_peer' in suite
    assert "--no-peer --compile" in suite and "step prefill_graphs_qwen3_8b_compiled" in suite

"""benchmarks.load.token_overhead end to end on the tiny llama (plumbing, not timing): a spawned transformers
server streams the same reply as the in-process decode of the same prompt ids, and the JSON is well formed."""

from __future__ import annotations

import json

import pytest

from benchmarks.load import token_overhead


@pytest.mark.slow
def test_token_overhead_runs_on_the_real_path(tmp_path, tiny_handle, capsys):
    model_dir = tmp_path / "tiny"
    tiny_handle.model.save_pretrained(model_dir)
    tiny_handle.tokenizer.save_pretrained(model_dir)
    out = tmp_path / "t.json"
    result = token_overhead.main(
        ["--reps", "2", "--max-tokens", "5", "--model", str(model_dir), "--out", str(out)]
    )
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == json.loads(out.read_text())
    assert len(result["reps"]) == 2 and result["env"]["git_sha"]
    for rep in result["reps"]:
        assert rep["completion_tokens"] == 5 and len(rep["steps_s"]) == 4  # steps after the first token
        assert len(rep["http_gaps_s"]) == rep["chunks"] - 1 and rep["loadavg"]
    assert result["overhead_p50_s"] == result["http_gap_p50_s"] - result["step_p50_s"]

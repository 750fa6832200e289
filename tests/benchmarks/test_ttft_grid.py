"""The benchmark scripts run end to end on a tiny random model: well-formed JSON, both arms over the same
token ids (identical greedy output), no timing asserted."""

from __future__ import annotations

import json

import pytest

from benchmarks import kv_load, ttft_grid
from kvmem.kv import PromptLayout


def test_ttft_grid_runs_and_writes_contract_json(tmp_path, tiny_handle, capsys):
    out = tmp_path / "grid.json"
    result = ttft_grid.main(
        ["--ctx", "120", "300", "--query", "40", "--reps", "1", "--new-tokens", "4", "--out", str(out)],
        handle=tiny_handle,
    )
    stdout = capsys.readouterr().out
    assert json.loads(stdout.strip().splitlines()[-1]) == result == json.loads(out.read_text())
    assert "KV TTFT (s)" in stdout and "Speedup (%)" in stdout
    assert {"python", "torch", "transformers", "git_sha", "device"} <= set(result["env"])
    assert [(c["ctx_target"], c["query_target"]) for c in result["cells"]] == [(120, 40), (300, 40)]
    required = {
        "model",
        "ctx_tokens",
        "query_tokens",
        "build_s",
        "kv_ttft_s",
        "direct_ttft_s",
        "ideal_ttft_s",
        "speedup_pct",
        "identical",
    }
    for cell in result["cells"]:
        assert required <= set(cell)
        assert cell["identical"] is True
        assert cell["ctx_tokens"] >= cell["ctx_target"] and cell["query_tokens"] >= cell["query_target"]
        assert all(cell[k] > 0 for k in ("build_s", "kv_ttft_s", "direct_ttft_s", "ideal_ttft_s"))


@pytest.mark.slow
def test_ttft_grid_compiled_arms_stay_identical(tmp_path, tiny_handle):
    result = ttft_grid.main(
        ["--ctx", "120", "--query", "40", "--reps", "1", "--new-tokens", "4", "--compile"]
        + ["--out", str(tmp_path / "grid.json")],
        handle=tiny_handle,
    )
    assert result["env"]["compiled"] is True
    (cell,) = result["cells"]
    assert cell["identical"] is True and cell["kv_ttft_s"] > 0


def test_grid_arms_share_token_ids(tiny_handle):
    layout = PromptLayout(tiny_handle.tokenizer)
    memories = ttft_grid.memories_for(layout, 200, seed=1)
    messages = ttft_grid.query_for(layout, memories, 50, seed=2)
    prompt = layout.prompt(memories, [], messages)
    block = layout.block_ids(memories)
    assert prompt.ids[: len(block)] == tuple(block) and len(block) >= 200
    assert len(prompt.ids) - len(block) >= 50


def test_kv_load_runs(tmp_path, tiny_handle):
    result = kv_load.main(
        ["--sizes", "100", "--reps", "1", "--out", str(tmp_path / "load.json")], handle=tiny_handle
    )
    (row,) = result["rows"]
    assert row["block_tokens"] >= 100 and row["num_bytes"] > 0 and row["load_verified_s"] > 0

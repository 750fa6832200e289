"""benchmarks/ttft/session_ttft.py end to end on the tiny llama behind two spawned transformers-backend servers
(plumbing and reuse accounting, not timing): with reuse each turn after the first is served from its session's
cache beyond the block, without it only the block is; both servers give the same replies to the same ids."""

from __future__ import annotations

import json

import pytest

from benchmarks.ttft import session_ttft
from tests.serving.kvstack import save_tiny_model


@pytest.mark.slow  # two spawned model servers, a few minutes on a loaded 2-core machine
def test_session_ttft_reuse_against_no_reuse(tmp_path, tiny_handle, capsys):
    model_dir = save_tiny_model(tmp_path / "tiny-model", tiny_handle)
    out = tmp_path / "s.json"
    args = [
        "--model",
        str(model_dir),
        "--turns",
        "3",
        "--repeats",
        "1",
        "--memories",
        "4",
        "--max-tokens",
        "3",
    ]
    result = session_ttft.main([*args, "--out", str(out)])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == json.loads(out.read_text())
    summary, rows = result["summary"], result["per_turn"]
    block = summary["block_tokens"]
    assert block > 0 and summary["block_unchanged"] is True
    assert summary["replies_identical"] is True
    assert [r["turn"] for r in rows] == [1, 2, 3]
    assert [r["no_reuse_cached_tokens"] for r in rows] == [block] * 3
    assert rows[0]["reuse_cached_tokens"] == block
    assert all(r["reuse_cached_tokens"] > block for r in rows[1:])
    assert all(r["reuse_prompt_tokens"] == r["no_reuse_prompt_tokens"] for r in rows)
    assert rows[2]["reuse_prompt_tokens"] > rows[1]["reuse_prompt_tokens"] > rows[0]["reuse_prompt_tokens"]
    assert len(result["turns"]) == 2 * 3 and "loadavg_end" in result["env"]
    assert isinstance(summary["target_last_within_1_5x_of_first"], bool)

"""benchmarks.engine.batch_agreement and batch_decode on the tiny llama: well-formed JSON, every request's greedy
output batched equal to alone, batched logits within rounding of alone (no timing asserted)."""

from __future__ import annotations

import json

from benchmarks.engine import batch_agreement, batch_decode


def test_batch_agreement_runs_and_writes_contract_json(tmp_path, tiny_handle, capsys):
    out = tmp_path / "agreement.json"
    result = batch_agreement.main(["--requests", "5", "--tokens", "4", "--out", str(out)], handle=tiny_handle)
    assert (
        json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result == json.loads(out.read_text())
    )
    row = result["agreement"]
    assert row["requests"] == 5 and row["outputs_identical"] == 5 and row["steps_compared"] == 5 * 3
    assert row["block_tokens"][0] == 0 and len(set(row["block_tokens"])) == 4  # no block, three blocks
    assert row["top1_agreement"] == 1.0 and 0.0 <= row["max_abs_logit_diff"] < 1e-3
    packed = result["packed"]  # 5 requests, 2 arriving per step, chunks of 16: prefill packed with decodes
    assert packed["chunk_tokens"] == 16 and packed["outputs_identical"] == 5
    assert packed["prefill_chunks_compared"] > 5 and packed["steps_with_prefill_and_decode"] >= 2
    assert packed["segments_compared"] == packed["prefill_chunks_compared"] + 5 * 3
    assert packed["top1_agreement"] == 1.0 and 0.0 <= packed["max_abs_logit_diff"] < 1e-3


def test_batch_decode_runs_both_arms_with_identical_tokens(tmp_path, tiny_handle, capsys):
    out = tmp_path / "decode.json"
    argv = ["--requests", "4", "--tokens", "3", "--reps", "1", "--out", str(out)]
    result = batch_decode.main(argv, handle=tiny_handle)
    assert (
        json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result == json.loads(out.read_text())
    )
    row = result["decode"]
    assert row["identical"] is True and (row["requests"], row["tokens_each"]) == (4, 3)
    assert row["round_robin_tokens_per_s"] > 0 and row["batched_tokens_per_s"] > 0
    assert len(row["loadavg_start"]) == 3

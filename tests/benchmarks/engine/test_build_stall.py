"""benchmarks/engine/build_stall.py on the tiny llama: a stream runs while a block builds through the production
backend, and the figures are taken from that run."""

from __future__ import annotations

import gc
import json


def test_build_stall_streams_while_a_block_builds(tmp_path, tiny_model_dir):
    from benchmarks.engine import build_stall

    out = tmp_path / "stall.json"
    argv = ["--model", str(tiny_model_dir), "--block-tokens", "300", "--tokens", "60", "--build-after", "3"]
    try:
        result = build_stall.main([*argv, "--pool-mb", "64", "--out", str(out)])
        assert gc.get_freeze_count() > 0  # the heap frozen once the model loaded, as kvmem serve does
    finally:
        gc.unfreeze()  # this process is the test run's, not a server's
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert list(result["arms"]) == ["engine"]
    for r in result["arms"].values():
        assert r["tokens"] == 60 and r["block_tokens"] >= 300
        assert r["gap_max_s"] >= r["gap_median_s"] > 0
        assert len(r["largest_gaps"]) == 5 and r["largest_gaps"][0]["gap_s"] == r["gap_max_s"]
        assert [g["gap_s"] for g in r["largest_gaps"]] == sorted(
            (g["gap_s"] for g in r["largest_gaps"]), reverse=True
        )
    assert result["arms"]["engine"]["build_chunk_tokens"] == 16  # the backend's default
    assert result["arms"]["engine"]["kv_pool_mb"] == 64

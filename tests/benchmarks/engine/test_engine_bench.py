"""benchmarks/engine/engine_bench.py on the tiny llama: it runs end to end and its figures are what the engine did
(the block's pages once, every batched output equal to the same request alone, no page left over)."""

from __future__ import annotations

import json


def test_engine_bench_runs_and_reports_shared_pages(tmp_path, tiny_handle):
    from benchmarks.engine import engine_bench

    out = tmp_path / "engine.json"
    argv = ["--block-tokens", "300", "--concurrent", "4", "--tokens", "5", "--requests", "6", "--chunk", "32"]
    result = engine_bench.main([*argv, "--pool-mb", "64", "--out", str(out)], handle=tiny_handle)
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    mem, agree = result["memory"], result["agreement"]
    page_bytes = mem["engine_peak_shared_bytes"] // -(-mem["block_tokens"] // 16)
    assert mem["engine_peak_shared_bytes"] == -(-mem["block_tokens"] // 16) * page_bytes
    assert mem["old_path_cache_bytes_after_prefill"] >= 4 * mem["block_bytes"]  # a copy per request
    assert mem["engine_peak_total_bytes"] < mem["old_path_cache_bytes_after_prefill"]
    assert agree["outputs_identical"] == agree["requests"] == 6 and agree["differing"] == []
    assert agree["pages_used_after"] == agree["pages_of_resident_blocks"]
    # the floor column (benchmarks/gpu/floor.py): on CPU no card, the step's bytes and FLOPs still counted
    assert sorted(mem["floor"]) == ["1", "4"] and mem["floor"]["1"]["card"] is None
    assert mem["floor"]["4"]["bytes"] > mem["floor"]["1"]["bytes"] > 0 and mem["floor"]["4"]["flops"] > 0

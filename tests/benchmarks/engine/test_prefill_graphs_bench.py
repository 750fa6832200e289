"""benchmarks/engine/prefill_graphs_bench.py at a tiny shape: both arms run a KV-injected request's query-only
forward through the engine's step, the static arm in a padded bucket, with the same first token; the GPU
suite runs it."""

from __future__ import annotations

import subprocess
from pathlib import Path

import torch

from benchmarks.engine.prefill_graphs_bench import run_cell
from serving.engine.pages import PagePool, PoolShape

ROOT = Path(__file__).resolve().parents[3]


def test_a_cell_runs_both_arms_with_the_same_first_token(tiny_handle):
    pool = PagePool(PoolShape.of_model(tiny_handle.model), 16 << 20)
    with torch.inference_mode():
        row = run_cell(tiny_handle, pool, ctx=200, query=40, reps=1)
    assert row["ctx_tokens"] >= 200 and row["query_tokens"] >= 40
    assert row["bucket"] == [(48, 512)] and row["replayed"] == 0 and row["failed"] == []
    assert row["attention"] == "mask" and "static_mask_ms" not in row  # flash and its comparison: CUDA only
    assert row["tokens_identical"] is True and row["eager_token"] == row["static_token"]
    # the whole prompt prefilled with no memory KV gives the injected request's first token (float32)
    assert (
        row["full_token_identical"] is True
        and row["full_token"] == row["full_eager_token"] == row["static_token"]
    )
    assert row["full_failed"] == [] and row["memos_speedup_pct"] is None  # not one of MemOS's cells
    kv, full = min(row["static_ms"], row["eager_ms"]), min(row["full_ms"], row["full_eager_ms"])
    assert row["reduction_pct"] == 100.0 * (1.0 - kv / full)
    assert row["floor_full"]["measured_over_floor"] is None
    # the floors: the query-only forward over the block for the KV arms, the whole prompt's for the full one
    assert row["floor_static"]["bytes"] == row["floor_eager"]["bytes"] < row["floor_full"]["bytes"]
    assert row["floor_static"]["flops"] < row["floor_full"]["flops"]
    assert row["floor_static"]["card"] is None and row["floor_static"]["measured_over_floor"] is None  # a CPU
    assert pool.prefill_graphs is None and pool.used_pages == pool.shared.page_count()


def test_the_gpu_suite_runs_it():
    suite = (ROOT / "benchmarks" / "gpu" / "gpu_suite.sh").read_text()
    assert subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / "gpu" / "gpu_suite.sh")]).returncode == 0
    assert "step prefill_graphs_qwen3_8b" in suite and "-m benchmarks.engine.prefill_graphs_bench" in suite
    assert "tests/serving/engine/test_prefill_graphs.py" in suite
    assert (
        "tests/serving/engine/test_fast_layers.py::test_on_cuda_in_float32" in suite
    )  # the fast path on CUDA

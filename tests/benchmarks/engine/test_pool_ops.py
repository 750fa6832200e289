"""benchmarks/engine/pool_ops.py at a tiny size: every operation is timed and the JSON written (no timing
asserted)."""

from __future__ import annotations

import json


def test_pool_ops_times_each_operation(tmp_path):
    from benchmarks.engine import pool_ops

    out = tmp_path / "pool_ops.json"
    result = pool_ops.main(
        ["--pages", "512", "--entries", "64", "--ops", "5", "--repeats", "2", "--out", str(out)]
    )
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert (result["pages"], result["entries"], result["users"]) == (512, 64, 100)
    assert list(result["ops_ms"]) == ["alloc_release", "evict_all", "stats", "alloc_full"]
    assert [v["n"] for v in result["ops_ms"].values()] == [5, 2, 20, 5]
    assert "loadavg" in result["env"] and "git_sha" in result["env"]

"""benchmarks/gpu/many_users_gpu.py on CPU with a tiny Qwen3 shape (the script's smoke, not figures): the engine
serving users' blocks from host memory into its pages and transformers' continuous batching (prefix sharing on)
over the pasted blocks give the same greedy tokens (float32), the engine loads blocks from the host tier (more
loads than users when the pool cannot hold them all), every figure the issue asks for is in the JSON, and the GPU
suite runs the script."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from benchmarks.gpu import many_users_gpu

ROOT = Path(__file__).resolve().parents[3]
SMOKE = "--users 6 --requests 8 --system 8 --block 40 --query 10 --new-tokens 4 --max-running 4"


def test_the_tiny_smoke_runs_both_arms_and_they_agree(tmp_path, capsys):
    out = tmp_path / "m.json"
    result = many_users_gpu.main(["--tiny", "--device", "cpu", *SMOKE.split(), "--out", str(out)])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == json.loads(out.read_text())
    assert result["env"]["git_sha"] and result["device_name"] == "cpu"
    assert result["attn_implementation_requested"] == "paged|sdpa"
    engine, peer = result["arms"]["engine"], result["arms"]["peer"]
    for arm in (engine, peer):
        assert arm["tokens"] == 8 * 4 and arm["tokens_per_s"] > 0
        assert sorted(arm["ttft_s"]) == ["p50", "p90", "p99"]
    assert engine["replies_equal_to_peer"] == 8
    # 5 distinct users in 8 requests; the pool holds about an eighth of the blocks: a block evicted is loaded
    # again, so there are more loads than users, each a whole block's K/V from host memory
    users = result["distinct_users_requested"]
    assert users == 5 and engine["loads"] > users and engine["overcommit"] > 1
    assert engine["bytes_loaded"] == engine["bytes_loaded_per_request"] * 8 > 0
    assert engine["floor"]["card"] is None and engine["floor"]["floor_s"] is None  # a CPU: no card
    assert engine["floor"]["bytes"] > 0 and engine["floor"]["flops"] > 0
    assert sorted(result["engine_over_peer"]) == ["tokens_per_s", "ttft_p50", "ttft_p99"]


def test_requests_admitted_in_one_turn_never_outgrow_the_pool_mid_reply(tmp_path):
    """The GPU run's shape, smaller: an eighth-sized pool, many requests admitted in one turn. Each takes its
    whole reply's pages when admitted; before, they outgrew the pool mid-reply and the run stopped."""
    args = "--users 16 --requests 24 --block 400 --new-tokens 16 --no-peer".split()
    result = many_users_gpu.main(["--tiny", "--device", "cpu", *args, "--out", str(tmp_path / "m.json")])
    engine = result["arms"]["engine"]
    assert engine["tokens"] == 24 * 16 and engine["overcommit"] > 1


def test_the_gpu_suite_runs_it():
    suite = (ROOT / "benchmarks" / "gpu" / "gpu_suite.sh").read_text()
    assert subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / "gpu" / "gpu_suite.sh")]).returncode == 0
    assert "step many_users_qwen3_8b" in suite and "-m benchmarks.gpu.many_users_gpu" in suite
    assert f"MU=(--tiny {SMOKE})" in suite  # SMOKE=1: the tiny shape, the sizes above

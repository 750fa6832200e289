"""benchmarks/gpu/many_users_bisect.sh on CPU (the tiny shape): the engine arm at this tree, this tree without its
eager warm-up, each tree of TREES_DIR, and this tree again, each JSON stamped with the commit it ran."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_it_runs_this_tree_then_each_tree_then_this_tree_again(tmp_path):
    trees = tmp_path / "trees"
    trees.mkdir()
    (trees / "abc1234").symlink_to(ROOT, target_is_directory=True)  # a tree of this code, named as a commit
    env = {**os.environ, "TREES_DIR": str(trees), "PYTHON": sys.executable, "KVMEM_GIT_SHA": "head1"}
    args = [
        "--tiny",
        "--device",
        "cpu",
        "--users",
        "3",
        "--requests",
        "4",
        "--block",
        "40",
        "--new-tokens",
        "2",
    ]
    out = tmp_path / "out"
    run = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu" / "many_users_bisect.sh"), str(out), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    names = sorted(p.name for p in out.iterdir())
    runs = {"abc1234": "abc1234", "head1": "head1", "head1_again": "head1", "head1_no_eager_warm": "head1"}
    assert names == [f"many_users_bisect_{n}.json" for n in sorted(runs)]
    for name, sha in runs.items():
        result = json.loads((out / f"many_users_bisect_{name}.json").read_text())
        assert result["env"]["git_sha"] == sha and result["args"]["no_peer"] is True
        assert result["args"]["no_eager_warm"] is (name == "head1_no_eager_warm")
        assert result["arms"]["engine"]["tokens"] == 4 * 2 and "peer" not in result["arms"]

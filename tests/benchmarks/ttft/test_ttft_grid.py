"""The benchmark scripts run end to end on a tiny random model: well-formed JSON, both arms over the same
token ids (identical greedy output), no timing asserted."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from benchmarks.tiers import kv_load
from benchmarks.ttft import ttft_grid
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
        assert cell["memos_speedup_pct"] is None  # not a MemOS cell
        assert cell["attempts"] == 1 and cell["waited_quiet_s"] == 0.0  # no --max-others-share
        # the floor columns (benchmarks/gpu/floor.py): the full prefill moves more than the query-only forward
        assert (
            cell["floor_ideal"]["card"] is None and cell["floor_kv"]["bytes"] == cell["floor_ideal"]["bytes"]
        )
        assert cell["floor_direct"]["flops"] > cell["floor_ideal"]["flops"] > 0
        # None: the timed window was shorter than one clock tick of /proc/stat (a fast machine, 1 rep)
        assert cell["others_cpu_share"] is None or 0.0 <= cell["others_cpu_share"] <= 1.0


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


def _shared_anchor() -> Path | None:
    """../shared/anchors/memos_kv_ttft.json beside this checkout, or beside the main checkout when this
    is a git worktree; None when neither exists (a user's clone)."""
    name = Path("shared", "anchors", "memos_kv_ttft.json")
    root = Path(__file__).resolve().parents[3]
    candidates = [root.parent / name]
    common = subprocess.run(
        ["git", "rev-parse", "--path-format=absolute", "--git-common-dir"],
        cwd=root,
        capture_output=True,
        text=True,
        check=False,
    )
    if common.returncode == 0 and common.stdout.strip():
        candidates.append(Path(common.stdout.strip()).parent.parent / name)
    return next((p for p in candidates if p.is_file()), None)


def test_memos_anchor_is_a_byte_identical_copy():
    shared = _shared_anchor()
    if shared is None:
        pytest.skip("no ../shared/anchors/memos_kv_ttft.json beside this checkout (a user's clone)")
    assert ttft_grid.MEMOS_ANCHOR.read_bytes() == shared.read_bytes()


def test_memos_comparison_figures_are_the_anchor_cells():
    cells = json.loads(ttft_grid.MEMOS_ANCHOR.read_text(encoding="utf-8"))["cells"]
    qwen = [c for c in cells if c["model"] == "Qwen3-8B"]
    assert sorted({c["query_tokens"] for c in qwen}) == [167.0, 302.7, 952.7]
    # the grid's query sizes are the source's averages rounded: 167, 302.7 -> 303, 952.7 -> 953
    to_grid = {167.0: 167, 302.7: 303, 952.7: 953}
    expected = {(c["ctx_tokens"], to_grid[c["query_tokens"]]): c["speedup_pct"] for c in qwen}
    assert len(expected) == len(qwen) == 9
    assert ttft_grid.MEMOS_QWEN3_8B == expected
    assert set(expected) == {(c, q) for c in ttft_grid.MEMOS_CTX for q in ttft_grid.MEMOS_QUERY}


def test_grid_cell_carries_the_anchor_figure(tmp_path, tiny_handle):
    result = ttft_grid.main(
        ["--ctx", "583", "--query", "167", "--reps", "1", "--warmup", "0", "--new-tokens", "2"]
        + ["--out", str(tmp_path / "grid.json")],
        handle=tiny_handle,
    )
    (cell,) = result["cells"]
    (anchor,) = [
        c
        for c in json.loads(ttft_grid.MEMOS_ANCHOR.read_text(encoding="utf-8"))["cells"]
        if (c["model"], c["ctx_tokens"], c["query_tokens"]) == ("Qwen3-8B", 583, 167.0)
    ]
    assert cell["memos_speedup_pct"] == anchor["speedup_pct"]
    assert (
        json.loads((tmp_path / "grid.json").read_text())["cells"][0]["memos_speedup_pct"]
        == anchor["speedup_pct"]
    )

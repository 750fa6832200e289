"""benchmarks.distill end to end on the tiny llama (plumbing, not figures): the production distill job runs per
size, the adapter it wrote is loaded back for the TTFT arms, and the JSON is well formed and complete."""

from __future__ import annotations

import json

import pytest

from benchmarks import distill


def test_synthetic_facts_parse_as_distinct_attribute_facts():
    from scheduler.distill_data import parse_fact

    texts = distill.synthetic_facts(50)
    facts = [parse_fact(f"m{i}", 1, t) for i, t in enumerate(texts)]
    assert all(f is not None and f.relation == "attribute" for f in facts)
    assert len({f.answer for f in facts}) == 50 and len({f.subject for f in facts}) == 50
    assert distill.synthetic_facts(5) == distill.synthetic_facts(5, 0) != distill.synthetic_facts(5, 1)


def test_distill_bench_runs_the_production_job_per_size(tmp_path, tiny_model_dir, capsys):
    pytest.importorskip("peft")
    out = tmp_path / "d.json"
    argv = ["--sizes", "2", "3", "--max-steps", "2", "--eval-every", "1", "--reps", "1"]
    result = distill.main([*argv, "--model", str(tiny_model_dir), "--out", str(out)])
    assert (
        json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == json.loads(out.read_text()) == result
    )
    assert result["env"]["git_sha"] and [row["num_facts"] for row in result["sizes"]] == [2, 3]
    for row in result["sizes"]:
        assert row["steps"] == 2 and row["train_s"] > 0
        # a random tiny model learns nothing in two steps: the gate refuses it and says why
        assert (row["passed"], row["recall_adapter"]) == (False, 0.0) and "recalls none" in row["reason"]
        assert row["prompt_tokens_saved"] == row["prompt_tokens_text"] - row["prompt_tokens_adapter"] > 0
        assert min(row["ttft_adapter_s"], row["ttft_kv_s"], row["ttft_text_s"]) > 0

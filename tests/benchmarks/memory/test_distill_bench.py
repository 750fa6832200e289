"""benchmarks.memory.distill end to end on the tiny llama (plumbing, not figures): the production distill job runs per
size, the adapter it wrote is loaded back for the TTFT arms, and the JSON is well formed and complete."""

from __future__ import annotations

import json

import pytest

from benchmarks.memory import distill


def test_synthetic_facts_parse_as_distinct_attribute_facts():
    from scheduler.distill.data import parse_fact

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
        # served for no fact: every fact stays in the adapter arm's block, no prompt token is saved
        assert row["num_facts_served"] == 0
        assert row["prompt_tokens_saved"] == row["prompt_tokens_text"] - row["prompt_tokens_adapter"] == 0
        assert min(row["ttft_adapter_s"], row["ttft_kv_s"], row["ttft_text_s"]) > 0


def test_the_adapter_arm_prompts_only_the_facts_the_adapter_is_not_served_for(tiny_handle):
    pytest.importorskip("peft")
    from kvmem.kv.layout import PromptLayout
    from tests.serving.lora_helpers import random_lora

    model, layout = random_lora(tiny_handle, seed=1), PromptLayout(tiny_handle.tokenizer)
    texts, question = distill.synthetic_facts(3), "What is my favourite colour?"
    bare = len(layout.prompt([], [], [{"role": "user", "content": question}]).ids)
    one = len(layout.prompt(texts[1:2], [], [{"role": "user", "content": question}]).ids)
    every = len(layout.prompt(texts, [], [{"role": "user", "content": question}]).ids)
    for unserved, tokens in (([], bare), (texts[1:2], one), (texts, every)):
        arms = distill.ttft_arms(model, layout, texts, question, 1, unserved)
        assert (arms["prompt_tokens_adapter"], arms["prompt_tokens_text"]) == (tokens, every)
        assert min(arms["ttft_adapter_s"], arms["ttft_kv_s"], arms["ttft_text_s"]) > 0
    assert bare < one < every

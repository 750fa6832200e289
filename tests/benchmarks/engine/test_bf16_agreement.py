"""benchmarks/engine/bf16_agreement.py's parts on the tiny model: its workload (blocks of different lengths and
none), its engine run, and its counts of agreement."""

from __future__ import annotations

from benchmarks.engine.bf16_agreement import compare, run, workload
from kvmem.kv import PromptLayout


def test_the_counts_of_a_run_against_itself_and_against_a_changed_copy(tiny_handle):
    requests = workload(PromptLayout(tiny_handle.tokenizer), 4)
    assert [m is None for _, m in requests] == [True, False, False, False]
    assert len({len(ids) for ids, _ in requests}) == 4  # prompts of different lengths
    reference = run(tiny_handle, requests, tokens=3, chunk=16)
    assert [len(t) for t in reference] == [3, 3, 3, 3] and run(tiny_handle, requests, 3, 16) == reference
    same = compare(reference, tiny_handle, requests, reference, near_tie=0.1)
    assert same["requests_identical"] == 4 and same["tokens_before_first_difference"] == 12
    assert same["first_differences"] == [] and same["near_ties"] == 0
    changed = [list(t) for t in reference]
    changed[2][1] += 1
    out = compare(reference, tiny_handle, requests, changed, near_tie=float("inf"))
    assert out["requests_identical"] == 3 and out["tokens_before_first_difference"] == 10
    assert [f["index"] for f in out["first_differences"]] == [1] and out["near_ties"] == 1
    assert out["first_differences"][0]["fp32_top2_gap"] >= 0

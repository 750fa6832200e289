"""benchmarks/engine/step_profile.py on the tiny llama: its op counts are what one step dispatches, counted
the same way each time, and a layer's share is part of the step's."""

from __future__ import annotations

import json


def test_step_profile_counts_ops_per_step_and_per_layer(tmp_path, tiny_handle):
    from benchmarks.engine import step_profile

    out = tmp_path / "profile.json"
    argv = "--rows 1 3 --decode-ctx 20 --chunks 8 --ctx 0 40 --reps 1 --profile-steps 2 --pool-mb 16".split()
    result = step_profile.main([*argv, "--out", str(out)], handle=tiny_handle)
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    cases = result["cases"]
    assert [(c["kind"], c.get("rows", c.get("chunk")), c["ctx"]) for c in cases] == [
        ("decode", 1, 20),
        ("decode", 3, 20),
        ("prefill", 8, 0),
        ("prefill", 8, 40),
    ]
    assert [c["rows_decoding"] for c in cases[:2]] == [1, 3]
    layers = result["layers"]
    for c in cases:
        # every step dispatches ops in each layer; layer 0's are part of the step's, and each layer runs the
        # same code, so the layers together account for at most the whole step
        assert 0 < c["ops_layer0_top_level"] <= c["ops_layer0"]
        assert 0 < c["ops_top_level"] <= c["ops"]
        assert layers * c["ops_layer0"] <= c["ops"]
    again = step_profile.main(argv, handle=tiny_handle)
    counts = [(c["ops"], c["ops_layer0"]) for c in cases]
    assert [(c["ops"], c["ops_layer0"]) for c in again["cases"]] == counts


def test_step_profile_says_which_path_ran_and_leaves_the_model_as_it_found_it(tiny_handle):
    """The fast path (the engine's own layers, serving/engine/models) by default where the model takes it,
    the generic one on request; a layer of the fast path dispatches at most half the generic one's ops in a
    one-row decode step (issue 43's target); the handle passed in keeps the path it had."""
    from benchmarks.engine import step_profile
    from serving.engine import models

    argv = "--rows 1 --decode-ctx 20 --chunks 8 --ctx 0 --reps 1 --profile-steps 1 --pool-mb 16".split()
    fast = step_profile.main(argv, handle=tiny_handle)
    generic = step_profile.main([*argv, "--path", "generic"], handle=tiny_handle)
    assert (fast["path"], fast["path_reason"], fast["compiled"]) == ("fast", None, False)
    assert (generic["path"], generic["path_reason"]) == ("generic", "--path generic")
    assert 2 * fast["cases"][0]["ops_layer0"] <= generic["cases"][0]["ops_layer0"]
    assert models.fast_for(tiny_handle.model) is None

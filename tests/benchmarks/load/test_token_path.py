"""benchmarks.load.token_path end to end on the tiny llama (plumbing and counts, not timing): the real server in
process with its probes, clients in a child process; every content token is traced from the step that made
it to its SSE write, and a step's tokens reach the event loop in one hop."""

from __future__ import annotations

import json

from benchmarks.load import token_path


def test_token_path_traces_every_token(tmp_path, tiny_handle, capsys):
    model_dir = tmp_path / "tiny"
    tiny_handle.model.save_pretrained(model_dir)
    tiny_handle.tokenizer.save_pretrained(model_dir)
    out = tmp_path / "t.json"
    result = token_path.main(
        [
            "--levels",
            "1",
            "3",
            "--max-tokens",
            "6",
            "--requests",
            "1",
            "--model",
            str(model_dir),
            "--out",
            str(out),
        ]
    )
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == json.loads(out.read_text())
    assert result["env"]["git_sha"] and [lv["clients"] for lv in result["levels"]] == [1, 3]
    for lv in result["levels"]:
        counts = lv["counts"]
        assert lv["completion_tokens"] == 6 * lv["clients"]
        assert lv["produced_to_written"]["n"] == counts["content_events"] > 0
        assert lv["client_gap"]["n"] == counts["content_events"] - lv["clients"]
        # one hop a turn with items, shared by the streams stepping together
        assert counts["loop_hops_per_content_token"] <= 1.0


def test_token_path_micro_counts_the_pieces(capsys):
    from benchmarks.load import token_path_micro

    ops = token_path_micro.main(["--reps", "20"])["ops"]
    assert sorted(ops) == sorted(
        [
            "wait_for(queue.get)",
            "Inbox.take",
            "is_disconnected",
            "event(chunk_dict)",
            "content_event",
            "detok.add",
        ]
    )
    assert 0 < ops["detok.add"]["calls_per_op"] < 200
    assert ops["Inbox.take"]["calls_per_op"] < ops["wait_for(queue.get)"]["calls_per_op"]
    assert ops["content_event"]["calls_per_op"] < ops["event(chunk_dict)"]["calls_per_op"]

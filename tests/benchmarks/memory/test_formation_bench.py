"""benchmarks.memory.formation_bench on a small slice of the synthetic sets: the JSON's keys, numbers in range, the
last stdout line equal to the file; the matching rule and the public-sample hook on hand-made cases."""

from __future__ import annotations

import json

from benchmarks.memory import formation_bench
from benchmarks.memory.formation_bench import match_count, score_extraction, score_public, text_score
from kvmem.formation.types import TurnInput

NOW = "2026-11-26T14:41:09.000000Z"


def _in_unit(value: object) -> bool:
    return value is None or (isinstance(value, float | int) and 0.0 <= value <= 1.0)


def test_main_on_a_slice(tmp_path, capsys) -> None:
    out = tmp_path / "formation.json"
    result = formation_bench.main(["--per-category", "2", "--passes", "1", "--out", str(out)])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == json.loads(out.read_text())
    assert (
        result["env"]["git_sha"] and len(result["env"]["loadavg"]) == len(result["env"]["loadavg_after"]) == 3
    )
    assert result["public"] == {"skipped": "no --public"}
    for name in ("dev", "heldout_v1", "heldout_v2"):
        report = result[name]
        extraction, supersession = report["extraction"], report["supersession"]
        assert extraction["num_cases"] >= 8 and extraction["num_expected"] > 0
        assert all(_in_unit(extraction[k]) for k in ("precision", "recall", "f1", "empty_case_accuracy"))
        assert all(
            _in_unit(v["precision"]) and _in_unit(v["recall"]) for v in extraction["per_category"].values()
        )
        assert _in_unit(report["dates"]["accuracy"]) and report["dates"]["num_cases"] >= (name == "dev")
        assert supersession["num_cases"] == 2 * len(supersession["per_category"])
        assert supersession["num_distractor_cases"] > 0
        for key in ("accuracy", "superseded_set_accuracy", "false_supersession_rate"):
            assert _in_unit(supersession[key]) and _in_unit(report["supersession_without_said_at"][key])
    speed = result["throughput"]
    assert speed["passes"] == 1 and speed["num_turns"] > speed["num_user_turns"] > 0
    assert speed["turns_per_s"] > 0 and speed["consolidation"]["facts_per_s"] > 0


def test_matching_rule() -> None:
    assert text_score("I live in Berlin!", "i live in berlin") == 1.0
    assert text_score("I live in Berlin", "I live in Bern") < 0.6
    assert text_score("I'm based in Porto these days", "I'm based in Porto") == 0.5
    # one to one: two predictions cannot both match one label
    assert match_count(["I love jazz", "I love jazz a lot"], ["I love jazz"]) == 1


def test_score_extraction_hook() -> None:
    cases = [
        (
            [TurnInput("a", "user", "I live in Berlin and I love jazz. Thanks!", NOW)],
            ["I live in Berlin", "I love jazz"],
        ),
        ([TurnInput("b", "user", "Hi there!", NOW)], []),
        ([TurnInput("c", "user", "I have a cat.", NOW)], ["I have a dog"]),
    ]
    got = score_extraction(cases)
    assert {k: got[k] for k in ("num_expected", "num_predicted", "num_matched", "precision", "recall")} == {
        "num_expected": 3,
        "num_predicted": 3,
        "num_matched": 2,
        "precision": 0.6667,
        "recall": 0.6667,
    }
    assert got["num_empty_cases"] == 1 and got["empty_case_accuracy"] == 1.0


def test_public_hook_skips_without_data(tmp_path) -> None:
    assert score_public(tmp_path / "missing.json", None, None)["skipped"].endswith("not found")  # type: ignore[arg-type]
    labels = tmp_path / "labels.json"
    labels.write_text(
        json.dumps({"turns": [{"chat": "Chat_1_A_B", "dia_id": "D1:1", "split": "tune", "facts": []}]})
    )
    skipped = score_public(labels, tmp_path / "no-realtalk", None)  # type: ignore[arg-type]
    assert skipped["skipped"].startswith("FileNotFoundError")


def test_main_over_an_endpoint_asks_each_batch_once_and_counts_failed_calls(tmp_path) -> None:
    """--extractor-url: the openai extractor over a loopback server that answers no facts, then garbage."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    bodies: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            content = '{"facts": []}' if len(bodies) % 2 else "I cannot help with that."
            payload = json.dumps({"choices": [{"message": {"content": content}}]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}/v1"
        result = formation_bench.main(
            [
                "--extractor-url",
                url,
                "--per-category",
                "1",
                "--extraction-only",
                "--out",
                str(tmp_path / "x.json"),
            ]
        )
    finally:
        httpd.shutdown()
        httpd.server_close()
    speed = result["throughput"]
    assert list(result) == [
        "benchmark",
        "env",
        "config",
        "heldout_v2",
        "throughput",
        "public",
        "public_tune_answers",
    ]
    assert result["public_tune_answers"] == []  # no --public
    assert (
        result["config"]["extractor"] == "openai" and result["heldout_v2"]["supersession"]["num_cases"] == 0
    )
    asked = {json.dumps(b["messages"]) for b in bodies}
    assert len(asked) == len(bodies) == speed["num_calls"]  # each distinct batch once
    assert speed["num_failed_calls"] == len(bodies) // 2 and len(speed["failed_calls"]) == len(bodies) // 2


def test_prefetch_asks_each_batch_once_in_parallel_and_the_scores_read_the_answers() -> None:
    import threading
    import time

    from kvmem.formation.errors import ExtractionError
    from kvmem.formation.types import Fact

    lock, calls, in_flight, most = threading.Lock(), [], [0], [0]

    class Slow:
        name = "slow"

        def extract(self, turns):
            with lock:
                calls.append(turns[0].id)
                in_flight[0] += 1
                most[0] = max(most[0], in_flight[0])
            time.sleep(0.05)
            with lock:
                in_flight[0] -= 1
            if turns[0].id == "bad":
                raise ExtractionError("no JSON", transient=False)
            return [Fact(f"fact of {turns[0].id}", (turns[0].id,), NOW)]

    remembered = formation_bench._Remembered(Slow())
    batches = [[TurnInput(i, "user", f"turn {i}", NOW)] for i in ("a", "b", "c", "bad", "a")]
    remembered.prefetch(batches, concurrency=3)
    assert sorted(calls) == ["a", "b", "bad", "c"] and most[0] == 3  # "a" twice in the batches: asked once
    assert remembered.errors == ["no JSON"]
    assert [f.text for f in remembered.extract(batches[1])] == ["fact of b"] and len(calls) == 4
    assert remembered.extract(batches[3]) == []


def test_bad_flags_exit_2_naming_them(capsys) -> None:
    import pytest

    for argv, named in (
        (["--concurrency", "0"], "--concurrency must be at least 1, got 0"),
        (["--public-only"], "--public-only needs --public"),
    ):
        with pytest.raises(SystemExit) as e:
            formation_bench.main(argv)
        assert e.value.code == 2 and named in capsys.readouterr().err


def test_public_only_scores_only_the_public_sample(tmp_path) -> None:
    result = formation_bench.main(["--public", str(tmp_path / "missing.json"), "--public-only"])
    assert list(result) == ["benchmark", "env", "config", "throughput", "public", "public_tune_answers"]
    assert result["public_tune_answers"] is None  # the rules: nothing remembered to show
    assert result["public"] == {"skipped": f"{tmp_path / 'missing.json'} not found"}
    assert result["config"]["public_only"] is True and result["throughput"]["num_turns"] == 0

"""Knowledge augmentation written by the served model (scheduler/distill/model_augment.py, issue 45 item 6).
The model's replies are scripted here (a given `generate`): what is checked is the prompt and schema it is
asked under, which of its questions are kept (a question, not holding its answer, not a validation or gate
question, not a repeat), the replies they are trained toward, and that the job trains on them. Whether the
questions help an adapter generalise is the benchmark's (benchmarks/memory/distill_paraphrase.py
--model-questions), with a real model."""

from __future__ import annotations

import json
import time

import pytest

import kvmem.text
from kvmem.adapters import AdapterRegistry
from kvmem.kv.layout import PromptLayout
from scheduler.distill import job as job_mod
from scheduler.distill.data import Example, gate_questions, parse_fact, valid_questions
from scheduler.distill.model_augment import QUESTIONS_SCHEMA, model_examples


def _script(*replies: str):
    calls: list[tuple[list[dict], dict, int]] = []

    def generate(messages, schema, max_tokens):
        calls.append((messages, schema, max_tokens))
        return replies[len(calls) - 1], "stop"

    return generate, calls


def test_the_models_questions_are_kept_only_where_they_are_new_questions_without_their_answer() -> None:
    dog = parse_fact("m0", 1, "My dog is called Miso.")
    gate = gate_questions([dog], seed=0)[0].question
    valid = valid_questions([dog])[0].question
    written = [
        "Remind me, what did I name my pup?",
        "What's my dog called?  ",  # kept, spaces tidied
        "what's my dog called",  # no question mark
        "Is my dog's name Miso?",  # holds its answer
        gate.upper(),  # a gate question (case ignored): the gate stays honest
        valid,  # a validation question
        "Remind me,  what did I name my pup?",  # a repeat
        "What is the name of your dog?",  # the assistant's dog: not the user's voice
        "Which name did the dog get?",  # no first-person word
        "Which name is on my dog's collar?",
    ]
    generate, calls = _script(json.dumps({"questions": written}))
    examples, counts = model_examples([dog], generate)
    assert examples == [
        Example("m0", "question", "Remind me, what did I name my pup?", "Your dog is called Miso.", "Miso"),
        Example("m0", "question", "What's my dog called?", "Miso.", "Miso"),
        Example("m0", "question", "Which name is on my dog's collar?", "Your dog's name is Miso.", "Miso"),
    ]
    assert counts == {"asked": 1, "written": 10, "kept": 3, "unparsed": 0, "closed": 0}
    ((messages, schema, max_tokens),) = calls
    assert schema is QUESTIONS_SCHEMA and max_tokens == 320
    assert messages[-1] == {"role": "user", "content": "Fact: My dog is called Miso.\nAnswer: Miso"}


def test_a_reply_cut_before_its_json_adds_nothing_for_that_fact_and_the_next_is_still_asked() -> None:
    facts = [parse_fact("m0", 1, "My dog is called Miso."), parse_fact("m1", 1, "I live in Porto.")]
    generate, calls = _script(
        '{"questions": ["What did I', json.dumps({"questions": ["Which city is home for me?"]})
    )
    examples, counts = model_examples(facts, generate)
    assert [(e.memory_id, e.question) for e in examples] == [("m1", "Which city is home for me?")]
    assert counts == {"asked": 2, "written": 1, "kept": 1, "unparsed": 1, "closed": 0} and len(calls) == 2


def test_a_reply_closed_to_fit_max_tokens_keeps_its_questions_but_the_last() -> None:
    home = parse_fact("m1", 1, "I live in Porto.")
    closed = {"questions": ["Which city is home for me?", "Where do I li"]}  # the engine closed the last one
    examples, counts = model_examples(
        [home], lambda messages, schema, max_tokens: (json.dumps(closed), "length")
    )
    assert [(e.memory_id, e.question) for e in examples] == [("m1", "Which city is home for me?")]
    assert counts == {"asked": 1, "written": 1, "kept": 1, "unparsed": 0, "closed": 1}


def test_the_job_trains_on_the_models_questions_beside_the_templates(
    tmp_path, tiny_handle, monkeypatch
) -> None:
    """distill_user with `generate`: the examples handed to training hold the model's kept questions as well as
    the template ones (training itself is stopped there: it is tested in test_distill.py)."""
    store = kvmem.text.MemoryStore(tmp_path / "memories.sqlite")
    store.add("alice", text="My dog is called Miso.")
    seen: list[list[Example]] = []

    class Stop(Exception):
        pass

    def train(model, tokenizer, layout, facts, examples, config, targets=None):
        seen.append(list(examples))
        raise Stop

    monkeypatch.setattr(job_mod, "train_adapter", train)
    generate, _ = _script(json.dumps({"questions": ["Remind me, what did I name my pup?"]}))
    with pytest.raises(Stop):
        job_mod.distill_user(
            "alice",
            store=store,
            registry=AdapterRegistry(tmp_path / "adapters"),
            handle=tiny_handle,
            layout=PromptLayout(tiny_handle.tokenizer),
            stats={},
            now=time.time(),
            config=job_mod.DistillConfig(),
            every=True,
            generate=generate,
        )
    questions = [e.question for e in seen[0]]
    assert questions.count("Remind me, what did I name my pup?") == 1
    assert len(questions) > 10  # the templates' examples too


def test_the_server_hands_the_served_model_to_the_job_only_under_distill_augment_model(
    tmp_path, caplog
) -> None:
    """`--distill-augment model` reaches the config; the background job then gets the backend's generate when
    the backend serves response formats, and templates only (with a log line) when it does not."""
    from types import SimpleNamespace

    from serving.background.distill import BackgroundDistill
    from serving.ops.cli import build_parser, config_from_args, main

    args = ["serve", "--data-dir", str(tmp_path), "--distill", "--distill-augment", "model"]
    config = config_from_args(build_parser().parse_args(args))
    assert config.distill_augment == "model"
    assert config_from_args(build_parser().parse_args(args[:4])).distill_augment == "templates"
    assert main([*args[:5], "--distill-augment", "rules"]) == 2

    def writer(augment: str, features: frozenset[str]):
        backend = SimpleNamespace(sampling_features=features, check_response_format=lambda fmt: None)
        return BackgroundDistill._writer(
            SimpleNamespace(config=SimpleNamespace(distill_augment=augment), backend=backend)
        )

    assert writer("templates", frozenset({"response_format"})) is None
    assert callable(writer("model", frozenset({"response_format"})))
    with caplog.at_level("WARNING"):
        assert writer("model", frozenset()) is None
    assert "serves no response format; templates only" in caplog.text

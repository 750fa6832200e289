"""`--extractor self` with the real default model in its own engine (serving/background/self_generate.py,
kvmem/formation/self_model.py): the extraction reply and every update decision are schema-valid JSON the
pipeline reads; a formation pass commits what the model decided; the server wires "self" to its backend, and
to the rules where the backend serves no response format."""

from __future__ import annotations

import asyncio
import json
from datetime import datetime, timezone

import jsonschema
import pytest

from kvmem.formation.llm import OpenAIExtractor
from kvmem.formation.self_model import _TEXT_MAX, EVENTS, FACTS_SCHEMA, ModelExtractor, atomic, update_schema
from kvmem.text import HashEmbedder, MemoryStore
from scheduler.formation import FormationWorker
from serving.backends.fake import FakeBackend
from serving.backends.transformers.backend import TransformersBackend, TransformersBackendConfig
from serving.background.formation import make_formation
from serving.background.self_generate import backend_generate
from serving.config import ServingConfig


@pytest.fixture(scope="module")
def backend(tmp_path_factory, default_model_dir):
    b = TransformersBackend(
        TransformersBackendConfig(model=str(default_model_dir), data_dir=str(tmp_path_factory.mktemp("self")))
    )
    b.load()
    yield b
    asyncio.run(b.aclose())


@pytest.fixture
def store(tmp_path):
    moment = datetime(2026, 11, 26, 12, 0, tzinfo=timezone.utc)
    s = MemoryStore(tmp_path / "m.sqlite", embedder=HashEmbedder(), clock=lambda: moment)
    yield s
    s.close()


class Recorded:
    """The backend's generate, each reply kept with its schema and finish reason (the model is not replaced)."""

    def __init__(self, backend) -> None:
        self.generate = backend_generate(backend)
        self.replies: list[tuple[dict, str, str]] = []

    def __call__(self, messages, schema, max_tokens):
        text, finish = self.generate(messages, schema, max_tokens)
        self.replies.append((schema, text, finish))
        return text, finish


@pytest.mark.slow
def test_a_formation_pass_on_the_default_model_is_schema_valid_and_commits_its_decisions(
    backend, store
) -> None:
    store.add("u", texts=["I work at Acme as an accountant."])
    store.log_turns(
        "u",
        [
            {
                "role": "user",
                "content": "I quit Acme last week and now I work as a nurse at the city hospital.",
            },
            {"role": "assistant", "content": "Congratulations on the new job!"},
            {"role": "user", "content": "thanks!"},
        ],
    )
    recorded = Recorded(backend)
    extractor = ModelExtractor(recorded)
    worker = FormationWorker(store, extractor, decider=extractor.decide)
    result = worker.form_user("u")
    # the user turns (an assistant turn is never formed)
    assert result.error is None and result.num_turns == 2
    extraction, *decisions = recorded.replies
    assert extraction[0] is FACTS_SCHEMA and extraction[2] == "stop"
    facts = json.loads(extraction[1])["facts"]
    jsonschema.validate({"facts": facts}, FACTS_SCHEMA)
    # the rules' guard found statements, so the model writes at least one fact (the schema's minItems: the
    # demo model answered {"facts": []} to every turn without it, and `self` formed nothing)
    assert len(facts) >= 1 and result.num_added >= 1
    # one decision per atomic fact: each model fact split into the rules' statements (self_model.atomic)
    said_at = store.list_turns("u").items[0].chat_time
    atoms = {
        " ".join(a.text.lower().split())
        for f in facts
        for a in atomic(OpenAIExtractor._fact(f, ("t",), said_at), cut=len(f["text"]) >= _TEXT_MAX)
    }
    assert len(decisions) == len(atoms) >= 1
    events = []
    for schema, text, finish in decisions:
        assert finish == "stop"
        reply = json.loads(text)
        jsonschema.validate(reply, schema)
        assert schema == update_schema(1) and reply["event"] in EVENTS  # the one memory shown
        events.append(reply)
    # the store holds what was decided: each add/update/delete a new memory, each update/delete naming the
    # memory supersedes it
    adds = [e for e in events if e["event"] != "none"]
    retire = [e for e in events if e["event"] in ("update", "delete") and e["memory"] is not None]
    assert result.num_added == len(adds)
    assert result.num_superseded == min(len(retire), 1)


@pytest.mark.slow
def test_chit_chat_never_reaches_the_model(backend, store) -> None:
    recorded = Recorded(backend)
    store.log_turns("u", [{"role": "user", "content": t} for t in ("hello!", "how are you?", "lol ok")])
    extractor = ModelExtractor(recorded)
    assert FormationWorker(store, extractor, decider=extractor.decide).form_user("u").num_added == 0
    assert recorded.replies == []


def test_the_server_wires_self_to_its_backend_and_to_the_rules_without_response_formats(tmp_path) -> None:
    store = MemoryStore(tmp_path / "m.sqlite", embedder=HashEmbedder())
    try:
        config = ServingConfig(data_dir=tmp_path, backend="transformers", extractor="self", auth=False)
        engine = TransformersBackend(TransformersBackendConfig(model="unused", data_dir=str(tmp_path)))
        worker = make_formation(config, store, backend=engine)
        assert worker.extractor.name == "self" and worker.decider == worker.extractor.decide
        worker = make_formation(config, store, backend=FakeBackend())
        assert worker.extractor.name == "rules"
        asyncio.run(engine.aclose())
    finally:
        store.close()


def test_the_facts_grammar_refuses_an_empty_list_and_takes_one_fact(default_model_dir) -> None:
    """The model is asked only for turns the rules' guard found a statement in, so its reply holds 1-3 facts:
    left free, the demo model answered {"facts":[]} to every turn and `self` formed nothing. Checked on the
    engine's own compiled grammar, token by token."""
    from transformers import AutoTokenizer

    from serving.engine.grammar import Grammars

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    grammars = Grammars(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    grammar = grammars.compile("json_schema", json.dumps(FACTS_SCHEMA))

    def takes(text: str) -> bool:
        matcher = grammar.matcher()
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return all(matcher.accept(t) for t in ids) and matcher.accept(tokenizer.eos_token_id)

    one = {"text": "I live in Oslo.", "kind": "fact", "subject": "user", "attribute": "home_city",
           "value": "oslo", "date": None}  # fmt: skip
    assert takes(json.dumps({"facts": [one]}, separators=(",", ":")))
    assert not takes('{"facts":[]}')
    assert not takes(json.dumps({"facts": [one] * 4}, separators=(",", ":")))

"""Structured outputs in the transformers backend (its engine's per-row token mask: serving/engine/grammar.py,
sampler.py). On the tiny llama (random weights: only the mask makes its reply JSON) and through HTTP: a greedy
reply under a JSON schema parses and validates; a row without a format decodes beside a constrained one with
exactly the tokens it gets alone; a reply that runs into max_tokens is closed early (it validates, ends with
"length", and departs from its uncut reply only where the model's token left no closing within the budget),
one that ends within its budget is untouched, one whose closing does not fit ends mid-JSON with "length"; json_object's reply is an object; a schema the backend cannot compile is a 400
invalid_response_format naming it. On the real default model (slow): its replies under a schema and under
json_object validate, where its free reply does not."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest
from openai import BadRequestError, OpenAI

from scheduler.wiring import make_scheduler
from serving.backends.base import GenerationRequest, ResponseFormat, SamplingParams
from serving.backends.transformers.backend import TransformersBackend, TransformersBackendConfig
from serving.config import ServingConfig
from serving.http.app import create_app
from tests.serving.backends.test_transformers_backend import arrive_together, tokens_of
from tests.serving.conftest import TickClock, live_server, wait_for

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["student", "teacher", "engineer"]},
        "pets": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 2},
        "home": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "pets", "home"],
    "additionalProperties": False,
}
ASK = "Describe Ana, a 34 year old teacher from Porto who has a cat called Miso, as JSON."


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir):
    yield from serve(tmp_path_factory, tiny_model_dir)


@pytest.fixture(scope="module")
def real_server(tmp_path_factory, default_model_dir):
    yield from serve(tmp_path_factory, default_model_dir)


def serve(tmp_path_factory, model_dir):
    import kvmem.text

    data = tmp_path_factory.mktemp("structured")
    backend = TransformersBackend(TransformersBackendConfig(model=str(model_dir), data_dir=str(data)))
    config = ServingConfig(
        data_dir=data, backend="transformers", auth=False, model=str(model_dir), store_turns=False
    )
    store = kvmem.text.MemoryStore(data / "memories.sqlite")
    scheduler = make_scheduler(config, store, backend, clock=TickClock())
    scheduler.start(thread=False)
    app = create_app(config, backend=backend, store=store, scheduler=scheduler)
    with live_server(app) as url:
        wait_for(backend.is_ready, "model load", tries=3000)
        yield url, backend
    scheduler.stop()


def request(backend, name: str, question: str, max_new: int, fmt: ResponseFormat | None) -> GenerationRequest:
    prompt = backend.layout_prompt([], [], [{"role": "user", "content": question}])
    sampling = SamplingParams(max_new_tokens=max_new, temperature=0.0, response_format=fmt)
    return GenerationRequest(name, "u", prompt, None, sampling)


def person_format(backend) -> ResponseFormat:
    fmt = ResponseFormat("json_schema", json.dumps(PERSON), "person")
    backend.check_response_format(fmt)  # as the chat path does before it streams
    return fmt


def text_of(backend, ids) -> str:
    return backend.handle.tokenizer.decode(ids, skip_special_tokens=True)


def test_a_constrained_greedy_reply_parses_and_validates(server):
    _, backend = server
    ids, result = asyncio.run(tokens_of(backend, request(backend, "c", ASK, 200, person_format(backend))))
    jsonschema.validate(json.loads(text_of(backend, ids)), PERSON)
    assert result.finish_reason == "stop"


@pytest.mark.slow
def test_the_default_models_constrained_greedy_reply_parses_and_validates(real_server):
    _, backend = real_server
    ids, result = asyncio.run(tokens_of(backend, request(backend, "c", ASK, 120, person_format(backend))))
    reply = json.loads(text_of(backend, ids))
    jsonschema.validate(reply, PERSON)
    assert result.finish_reason == "stop"
    # unconstrained, the same model does not answer with that object
    free, _ = asyncio.run(tokens_of(backend, request(backend, "f", ASK, 120, None)))
    with pytest.raises((ValueError, jsonschema.ValidationError)):
        jsonschema.validate(json.loads(text_of(backend, free)), PERSON)


@pytest.mark.slow
def test_the_default_models_json_object_reply_is_one_json_object(real_server):
    _, backend = real_server
    fmt = ResponseFormat("json_object")
    backend.check_response_format(fmt)
    ids, result = asyncio.run(
        tokens_of(
            backend,
            request(
                backend,
                "o",
                'Reply with a JSON object with one key, "city", set to the capital of France.',
                200,
                fmt,
            ),
        )
    )
    assert result.finish_reason == "stop", text_of(backend, ids)  # the object closed, not cut at max_tokens
    assert isinstance(json.loads(text_of(backend, ids)), dict)


def test_a_row_without_a_format_decodes_beside_a_constrained_one_with_its_tokens_alone(server):
    _, backend = server
    fmt = person_format(backend)
    constrained = request(backend, "c", ASK, 40, fmt)
    plain = request(backend, "p", "Name three colours of the rainbow and say why the sky is blue.", 24, None)
    alone = [asyncio.run(tokens_of(backend, r))[0] for r in (constrained, plain)]
    together = arrive_together(backend, [constrained, plain])
    assert [ids for ids, _ in together] == alone
    assert len(alone[1]) == 24
    jsonschema.validate(json.loads(text_of(backend, alone[0])), PERSON)  # closed to fit its 40 tokens


def test_a_reply_that_runs_into_max_tokens_is_closed_by_the_grammars_closing_and_validates(server):
    _, backend = server
    fmt = person_format(backend)
    full, done = asyncio.run(tokens_of(backend, request(backend, "full", ASK, 200, fmt)))
    assert done.finish_reason == "stop"
    # a reply that ends within its budget, however tight, is the model's own
    tight, result = asyncio.run(tokens_of(backend, request(backend, "tight", ASK, len(full) + 1, fmt)))
    assert (tight, result.finish_reason) == (full, "stop")
    budget = len(full) - 8
    cut, result = asyncio.run(tokens_of(backend, request(backend, "cut", ASK, budget, fmt)))
    assert result.finish_reason == "length"  # the model did not end it
    jsonschema.validate(json.loads(text_of(backend, cut)), PERSON)
    departs = next(i for i, (a, b) in enumerate(zip(cut, full, strict=False)) if a != b)
    matcher = backend._grammar_for(fmt).matcher()
    for token in full[: departs + 1]:
        assert matcher.accept(token)
    # where the reply departs from the model's own, the model's token left no closing within the budget
    assert len(matcher.closing_tokens()) > budget - departs - 1


def test_every_benchmark_schema_closes_from_its_first_brace_with_a_document_that_validates(server):
    from benchmarks.engine.structured_bench import SCHEMAS

    _, backend = server
    tokenizer = backend.handle.tokenizer
    opening = tokenizer.encode("{", add_special_tokens=False)
    for case in json.loads(SCHEMAS.read_text()):
        matcher = backend._grammar_for(
            ResponseFormat("json_schema", json.dumps(case["schema"]), "s")
        ).matcher()
        assert all(matcher.accept(t) for t in opening)
        closing = matcher.closing_tokens()
        assert closing, case["name"]
        jsonschema.validate(json.loads("{" + tokenizer.decode(closing)), case["schema"])


def test_a_json_object_reply_that_runs_into_max_tokens_is_one_closed_object(server):
    _, backend = server
    fmt = ResponseFormat("json_object")
    backend.check_response_format(fmt)
    ids, result = asyncio.run(tokens_of(backend, request(backend, "o", "Write JSON about the sun.", 48, fmt)))
    assert result.finish_reason == "length"
    assert isinstance(json.loads(text_of(backend, ids)), dict)
    opening = backend.handle.tokenizer.encode("[", add_special_tokens=False)
    assert not backend._grammar_for(fmt).matcher().accept(opening[0])  # an object, never an array


def test_max_tokens_reached_mid_json_with_no_room_to_close_ends_with_length(server):
    _, backend = server
    fmt = person_format(backend)
    full, _ = asyncio.run(tokens_of(backend, request(backend, "full", ASK, 120, fmt)))
    cut, result = asyncio.run(tokens_of(backend, request(backend, "cut", ASK, 6, fmt)))
    assert result.finish_reason == "length"
    assert cut == full[:6]
    with pytest.raises(ValueError):
        json.loads(text_of(backend, cut))


def test_through_http_a_schema_is_honoured_and_one_that_cannot_compile_is_a_400_naming_it(server):
    url, backend = server
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": ASK}]
    out = client.chat.completions.create(
        model=backend.model_id,
        messages=messages,
        user="alice",
        temperature=0,
        max_tokens=200,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
    )
    jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)
    assert out.choices[0].finish_reason == "stop"
    bad = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 1}}}
    with pytest.raises(BadRequestError) as refused:
        client.chat.completions.create(
            model=backend.model_id,
            messages=messages,
            user="alice",
            response_format={"type": "json_schema", "json_schema": {"name": "broken_range", "schema": bad}},
        )
    assert refused.value.body["code"] == "invalid_response_format"
    assert refused.value.body["param"] == "response_format"
    assert refused.value.body["message"] == (
        "response_format: the json_schema 'broken_range' cannot be compiled: "
        "Invalid range: minimum greater than maximum"
    )
    with pytest.raises(BadRequestError) as endless:  # it compiled, then failed its first step: a 500
        client.chat.completions.create(
            model=backend.model_id,
            messages=messages,
            user="alice",
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "itself", "schema": {"$ref": "#"}},
            },
        )
    assert endless.value.body["code"] == "invalid_response_format"
    assert endless.value.body["message"].startswith(
        "response_format: the json_schema 'itself' cannot be compiled: the response format admits no JSON document"
    )
    with pytest.raises(BadRequestError) as unnamed:
        client.chat.completions.create(
            model=backend.model_id,
            messages=messages,
            user="alice",
            response_format={"type": "json_schema", "json_schema": {"schema": PERSON}},
        )
    assert unnamed.value.body["code"] == "invalid_value"
    assert unnamed.value.body["param"] == "response_format.json_schema.name"


def test_two_first_structured_requests_never_compile_on_the_model_thread(server, monkeypatch):
    import threading
    import time

    from serving.engine import grammar

    _, backend = server
    compiled_on: list[threading.Thread] = []
    compile, init = grammar.Grammars.compile, grammar.Grammars.__init__

    def recorded_compile(self, kind, schema=None):
        compiled_on.append(threading.current_thread())
        return compile(self, kind, schema)

    def slow_init(self, *args):  # widens the window two first requests race through
        time.sleep(0.2)
        init(self, *args)

    monkeypatch.setattr(grammar.Grammars, "compile", recorded_compile)
    monkeypatch.setattr(grammar.Grammars, "__init__", slow_init)
    monkeypatch.setattr(grammar, "CACHE_SIZE", 1)  # the second schema evicts the first before either runs
    monkeypatch.setattr(backend, "_grammars", None)  # the backend's first structured requests
    pets = {"type": "object", "properties": {"pets": {"type": "array", "items": {"type": "string"}}}}
    formats = [
        ResponseFormat("json_schema", json.dumps(PERSON), "person"),
        ResponseFormat("json_schema", json.dumps(pets), "pets"),
    ]
    checks = [threading.Thread(target=backend.check_response_format, args=(f,)) for f in formats]
    for t in checks:
        t.start()
    for t in checks:
        t.join()
    requests = [
        request(backend, "a", ASK, 12, formats[0]),
        request(backend, "b", "List my pets.", 7, formats[1]),
    ]
    results = arrive_together(backend, requests)
    assert all(r.finish_reason in ("stop", "length") for _, r in results)
    model_thread = backend._loop._thread
    assert compiled_on and model_thread not in compiled_on

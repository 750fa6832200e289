"""OpenAI chat parameters through HTTP (fake backend: exact JSON) and through the transformers backend on the
tiny llama (exact tokens and logprobs): what is served, and each refusal's exact error."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi.testclient import TestClient

from kvmem.kv import GenerationStats, Sampling, generate
from serving.backends.base import (
    GenerationRequest,
    InvalidResponseFormat,
    LaidOutPrompt,
    ResponseFormat,
    SamplingParams,
    TokenDelta,
)
from serving.engine.detok import TokenPieces
from tests.serving.backends.test_transformers_backend import arrive_together, tokens_of
from tests.serving.conftest import ALICE, MODEL, Stack, wait_for


def body(content: str = "hello", **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_a_body_not_sent_as_json_is_refused_saying_so(stack: Stack, client: TestClient, content_type) -> None:
    headers = dict(ALICE) | ({"Content-Type": content_type} if content_type else {})
    r = client.post("/v1/chat/completions", content=json.dumps(body()), headers=headers)
    assert (r.status_code, r.json()) == (
        415,
        {
            "error": {
                "message": "the request body must be JSON sent with Content-Type: application/json",
                "type": "invalid_request_error",
                "param": None,
                "code": "unsupported_media_type",
            }
        },
    )
    assert stack.backend.requests == []
    headers["Content-Type"] = "application/json; charset=utf-8"
    assert client.post("/v1/chat/completions", content=json.dumps(body()), headers=headers).status_code == 200


def error(status: int, message: str, param: str | None, code: str | None) -> tuple[int, dict]:
    return status, {
        "error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}
    }


def post(client: TestClient, payload: dict):
    return client.post("/v1/chat/completions", json=payload, headers=ALICE)


def test_penalties_logit_bias_and_logprobs_reach_the_backend(stack: Stack, client: TestClient) -> None:
    r = post(
        client,
        body(
            presence_penalty=0.5,
            frequency_penalty=-1,
            logit_bias={"42": 100, "7": -2.5},
            logprobs=True,
            top_logprobs=3,
            response_format={"type": "text"},
            tools=[],
            tool_choice="none",
            modalities=["text"],
            max_tokens=4,
        ),
    )
    assert r.status_code == 200
    assert stack.backend.requests[-1].sampling == SamplingParams(
        max_new_tokens=4,
        presence_penalty=0.5,
        frequency_penalty=-1.0,
        logit_bias=((7, -2.5), (42, 100.0)),
        top_logprobs=3,
    )
    post(client, body(logprobs=True))
    assert stack.backend.requests[-1].sampling == SamplingParams(max_new_tokens=256, top_logprobs=0)
    post(client, body(logprobs=False, presence_penalty=0, logit_bias={}))
    assert stack.backend.requests[-1].sampling == SamplingParams(max_new_tokens=256)


def entry(ch: str, top: int) -> dict:
    """fake_logprob's JSON: the character at -0.25, its top list itself then the next code points."""
    tops = [
        {"token": chr(ord(ch) + j), "logprob": -0.25 - j, "bytes": list(chr(ord(ch) + j).encode())}
        for j in range(top)
    ]
    return {"token": ch, "logprob": -0.25, "bytes": list(ch.encode()), "top_logprobs": tops}


def test_completion_logprobs_have_openais_shape(stack: Stack, client: TestClient) -> None:
    stack.backend.reply = "aé"
    r = post(client, body(logprobs=True, top_logprobs=2))
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == "aé"
    assert choice["logprobs"] == {"content": [entry("a", 2), entry("é", 2)], "refusal": None}
    assert choice["logprobs"]["content"][1]["bytes"] == [195, 169]
    r = post(client, body(logprobs=True))
    assert r.json()["choices"][0]["logprobs"] == {"content": [entry("a", 0), entry("é", 0)], "refusal": None}
    assert post(client, body()).json()["choices"][0]["logprobs"] is None


def test_stream_chunks_carry_their_logprobs(stack: Stack, client: TestClient) -> None:
    stack.backend.reply = "ab"
    r = post(client, body(logprobs=True, top_logprobs=1, stream=True))
    events = [json.loads(line[6:]) for line in r.text.split("\n\n") if line and line != "data: [DONE]"]
    assert [e["choices"][0]["delta"] for e in events] == [
        {"role": "assistant", "content": ""},
        {"content": "a"},
        {"content": "b"},
        {},
    ]
    assert [e["choices"][0]["logprobs"] for e in events] == [
        None,
        {"content": [entry("a", 1)], "refusal": None},
        {"content": [entry("b", 1)], "refusal": None},
        None,
    ]


UNSUPPORTED = [
    (
        {"modalities": ["text", "audio"]},
        "modalities",
        "modalities ['audio'] are not supported; this server answers in text",
    ),
    (
        {"audio": {"voice": "alloy", "format": "wav"}},
        "audio",
        "`audio` is not supported; this server answers in text",
    ),
    (
        {"tools": [{"type": "function", "function": {"name": "f"}}]},
        "tools",
        "`tools` is not supported: this server does not call tools",
    ),
    (
        {"tool_choice": "auto"},
        "tool_choice",
        "`tool_choice` is not supported: this server does not call tools",
    ),
    (
        {"functions": [{"name": "f"}]},
        "functions",
        "`functions` is not supported: this server does not call tools",
    ),
    (
        {"function_call": "auto"},
        "function_call",
        "`function_call` is not supported: this server does not call tools",
    ),
    (  # the fake backend's scripted replies follow no format
        {"response_format": {"type": "json_object"}},
        "response_format",
        "`response_format` is not supported by the fake backend",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
        "response_format",
        "`response_format` is not supported by the fake backend",
    ),
    (
        {"response_format": {"type": "grammar"}},
        "response_format",
        "response_format of type 'grammar' is not supported; 'text', 'json_object' and 'json_schema' are",
    ),
]


@pytest.mark.parametrize(
    ("spec", "param", "message"),
    [
        (
            {"type": "json_schema"},
            "response_format.json_schema",
            "response_format of type 'json_schema' needs `json_schema`: an object with `name` and `schema`",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}},
            "response_format.json_schema.name",
            "response_format.json_schema.name must be 1 to 64 letters, digits, underscores or dashes, got 'a b'",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}},
            "response_format.json_schema.schema",
            "response_format.json_schema.schema of 'x' must be a JSON Schema object, got list",
        ),
    ],
)
def test_a_malformed_response_format_is_refused_naming_its_field(
    stack: Stack, client: TestClient, spec, param, message
) -> None:
    r = post(client, body(response_format=spec))
    assert (r.status_code, r.json()) == error(400, message, param, "invalid_value")
    assert stack.backend.requests == []


@pytest.mark.parametrize(("extra", "param", "message"), UNSUPPORTED)
def test_unserved_parameters_are_refused_by_name(
    stack: Stack, client: TestClient, extra, param, message
) -> None:
    r = post(client, body(**extra))
    assert (r.status_code, r.json()) == error(400, message, param, "unsupported_parameter")
    assert stack.backend.requests == []


@pytest.mark.parametrize(
    ("part", "kind"),
    [
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}, "image_url"),
        ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "input_audio"),
        ({"type": "file", "file": {"file_id": "f"}}, "file"),
    ],
)
def test_image_and_audio_parts_are_refused_by_type(stack: Stack, client: TestClient, part, kind) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, part]}]
    r = post(client, {"model": MODEL, "messages": messages})
    assert (r.status_code, r.json()) == error(
        400,
        f"messages[0].content[1]: content parts of type {kind!r} are not supported; only 'text' parts are",
        "messages[0].content[1]",
        "unsupported_content",
    )
    assert stack.backend.requests == []
    messages[0]["content"] = [{"type": "text", "text": "what "}, {"type": "text", "text": "is this?"}]
    assert post(client, {"model": MODEL, "messages": messages}).status_code == 200
    assert stack.backend.decode(stack.backend.requests[-1].prompt.ids).endswith(
        "<user>what is this?\n<assistant>"
    )


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (
            {"logit_bias": {"1114112": 1}},
            error(
                400,
                "logit_bias token id 1114112 is not in the vocabulary (ids 0..1114111)",
                "logit_bias",
                "invalid_value",
            ),
        ),
        (  # int() refuses a string of over 4,300 digits: it was a 500
            {"logit_bias": {"9" * 4301: 1}},
            error(
                400,
                f"logit_bias token id {'9' * 18}... is not in the vocabulary (ids 0..1114111)",
                "logit_bias",
                "invalid_value",
            ),
        ),
        (
            {"logit_bias": {"abc": 1}},
            error(
                400,
                "logit_bias keys must be token ids (decimal strings), got 'abc'",
                "logit_bias",
                "invalid_value",
            ),
        ),
        (
            {"logit_bias": {"-1": 1}},
            error(
                400,
                "logit_bias keys must be token ids (decimal strings), got '-1'",
                "logit_bias",
                "invalid_value",
            ),
        ),
        (
            {"logit_bias": {"5": 100.5}},
            error(
                400, "logit_bias['5'] is 100.5; biases must be in [-100, 100]", "logit_bias", "invalid_value"
            ),
        ),
        (
            {"logit_bias": {str(i): 1 for i in range(301)}},
            error(400, "logit_bias may have at most 300 entries", "logit_bias", None),
        ),
        (
            {"top_logprobs": 2},
            error(400, "top_logprobs needs logprobs: true", "top_logprobs", "invalid_value"),
        ),
        (
            {"logprobs": True, "top_logprobs": 21},
            error(
                400,
                "invalid request: top_logprobs: Input should be less than or equal to 20",
                "top_logprobs",
                "invalid_value",
            ),
        ),
        (
            {"presence_penalty": 2.5},
            error(
                400,
                "invalid request: presence_penalty: Input should be less than or equal to 2",
                "presence_penalty",
                "invalid_value",
            ),
        ),
    ],
)
def test_bad_values_are_refused(stack: Stack, client: TestClient, extra, expected) -> None:
    r = post(client, body(**extra))
    assert (r.status_code, r.json()) == expected
    assert stack.backend.requests == []


def test_a_backend_that_cannot_apply_a_feature_refuses_it_by_name(stack: Stack, client: TestClient) -> None:
    stack.backend.sampling_features = frozenset(
        {"presence_penalty", "frequency_penalty", "logit_bias"}
    )  # as vLLM
    stack.backend.name = "vllm"
    r = post(client, body(logprobs=True))
    assert (r.status_code, r.json()) == error(
        400, "`logprobs` is not supported by the vllm backend", "logprobs", "unsupported_parameter"
    )
    assert post(client, body(logprobs=False, frequency_penalty=1, logit_bias={"3": 5})).status_code == 200
    stack.backend.sampling_features = frozenset()
    r = post(client, body(frequency_penalty=1, presence_penalty=1))
    assert r.json()["error"]["param"] == "frequency_penalty"  # the first refused, by name order
    assert post(client, body(frequency_penalty=0)).status_code == 200


# -- the transformers backend on the tiny llama ---------------------------------------------------------------


def tiny_request(backend, rid: str, question: str, sampling: SamplingParams) -> GenerationRequest:
    prompt = backend.layout_prompt([], [], [{"role": "user", "content": question}])
    return GenerationRequest(rid, "u", prompt, None, sampling)


async def deltas_of(backend, req) -> list[TokenDelta]:
    return [item async for item in backend.stream(req) if isinstance(item, TokenDelta)]


def test_transformers_backend_logprobs_are_the_decode_loops(tiny_backend) -> None:
    backend = tiny_backend
    sp = SamplingParams(
        max_new_tokens=12, temperature=0.0, presence_penalty=1.0, logit_bias=((321, 4.0),), top_logprobs=3
    )
    req = tiny_request(backend, "lp", "Where do I live?", sp)
    deltas = asyncio.run(deltas_of(backend, req))
    ids = [t for d in deltas for t in d.token_ids]
    entries = [e for d in deltas for e in d.logprobs]
    assert all(len(d.logprobs) == len(d.token_ids) for d in deltas)
    stats = GenerationStats()
    sampling = Sampling(max_new_tokens=12, presence_penalty=1.0, logit_bias=((321, 4.0),), top_logprobs=3)
    expected = list(generate(backend.handle.model, req.prompt.ids, sampling=sampling, stats=stats))
    assert ids == expected[: len(ids)] and len(ids) >= 1
    pieces = TokenPieces(backend.handle.tokenizer)
    for e, lp in zip(entries, stats.logprobs, strict=False):
        assert (e.token, e.bytes) == pieces(lp.token_id)
        assert e.logprob == pytest.approx(lp.logprob, abs=1e-5)
        assert [(t.token, t.bytes) for t in e.top_logprobs] == [pieces(t) for t, _ in lp.top]
        assert [t.logprob for t in e.top_logprobs] == pytest.approx([v for _, v in lp.top], abs=1e-5)
    raw = b"".join(bytes(e.bytes) for e in entries)
    assert raw.decode("utf-8", errors="replace") == backend.handle.tokenizer.decode(ids)


# six ordinary tokens far above the rest: the frequency penalty picks among them
BIAS_SIX = tuple((t, 100.0) for t in range(1000, 1006))


def test_transformers_backend_batches_requests_with_and_without_the_parameters(tiny_backend) -> None:
    backend = tiny_backend
    samplings = [
        SamplingParams(max_new_tokens=8, temperature=0.0),
        SamplingParams(max_new_tokens=8, temperature=0.0, logit_bias=((1234, 100.0),), top_logprobs=2),
        SamplingParams(max_new_tokens=8, temperature=0.0, frequency_penalty=2.0, logit_bias=BIAS_SIX),
    ]
    questions = ["Hi", "What is my dog called?", "Where do I live?"]
    requests = [
        tiny_request(backend, f"b{i}", q, sp)
        for i, (q, sp) in enumerate(zip(questions, samplings, strict=True))
    ]
    alone = [asyncio.run(tokens_of(backend, r)) for r in requests]
    together = arrive_together(backend, requests)
    assert [ids for ids, _ in together] == [ids for ids, _ in alone]
    assert alone[1][0] == [1234] * 8
    unpenalised = SamplingParams(max_new_tokens=8, temperature=0.0, logit_bias=BIAS_SIX)
    plain = asyncio.run(tokens_of(backend, tiny_request(backend, "p", questions[2], unpenalised)))[0]
    assert set(alone[2][0]) <= {t for t, _ in BIAS_SIX} and plain != alone[2][0]  # the penalty took effect


def test_vllm_sampling_params_carry_the_penalties_logit_bias_and_response_format() -> None:
    pytest.importorskip("vllm")
    from serving.backends.vllm.backend import VllmBackend
    from serving.backends.vllm.request import sampling_params

    prompt = LaidOutPrompt((1, 2, 3), 0)
    sp = SamplingParams(max_new_tokens=4, presence_penalty=0.5, frequency_penalty=1.0, logit_bias=((7, 2.0),))
    params = sampling_params(GenerationRequest("r", "u", prompt, None, sp), 100, {2})
    assert (params.presence_penalty, params.frequency_penalty, params.logit_bias) == (0.5, 1.0, {7: 2.0})
    params = sampling_params(GenerationRequest("r", "u", prompt, None, SamplingParams(4)), 100, {2})
    assert (params.presence_penalty, params.frequency_penalty, params.logit_bias) == (0.0, 0.0, None)
    assert VllmBackend.sampling_features == {
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "response_format",
    }
    schema = '{"type":"object","properties":{"a":{"type":"integer"}}}'
    fmt = ResponseFormat("json_schema", schema, "s")
    guided = sampling_params(
        GenerationRequest("r", "u", prompt, None, SamplingParams(4, response_format=fmt)), 100, {2}
    )
    assert (guided.structured_outputs.json, guided.structured_outputs.disable_any_whitespace) == (
        schema,
        True,
    )
    assert params.structured_outputs is None
    fmt = ResponseFormat("json_object")
    guided = sampling_params(
        GenerationRequest("r", "u", prompt, None, SamplingParams(4, response_format=fmt)), 100, {2}
    )
    assert guided.structured_outputs.json_object is True
    with pytest.raises(InvalidResponseFormat, match='Unsupported type "foo"'):
        VllmBackend.check_response_format(None, ResponseFormat("json_schema", '{"type":"foo"}', "s"))


def test_the_openai_client_parses_logprobs_and_the_refusals(tmp_path) -> None:
    from openai import BadRequestError, OpenAI

    from serving.backends.fake import FakeBackend
    from tests.serving.conftest import live_server, make_stack

    stack = make_stack(tmp_path, backend=FakeBackend(reply="ok"))
    try:
        with live_server(stack.app) as url:
            api = OpenAI(base_url=f"{url}/v1", api_key="sk-alice-0000", max_retries=0)
            messages = [{"role": "user", "content": "hi"}]
            out = api.chat.completions.create(
                model=MODEL,
                messages=messages,
                user="alice",
                logprobs=True,
                top_logprobs=2,
                logit_bias={"5": 1},
            )
            content = out.choices[0].logprobs.content
            assert [(c.token, c.logprob, c.bytes) for c in content] == [
                ("o", -0.25, [111]),
                ("k", -0.25, [107]),
            ]
            assert [(t.token, t.logprob) for t in content[1].top_logprobs] == [("k", -0.25), ("l", -1.25)]
            chunks = list(
                api.chat.completions.create(
                    model=MODEL, messages=messages, user="alice", logprobs=True, stream=True
                )
            )
            streamed = [c.choices[0].logprobs.content for c in chunks if c.choices and c.choices[0].logprobs]
            assert [[e.token for e in lps] for lps in streamed] == [["o"], ["k"]]
            with pytest.raises(BadRequestError) as refused:
                api.chat.completions.create(
                    model=MODEL, messages=messages, user="alice", response_format={"type": "json_object"}
                )
            assert refused.value.body["param"] == "response_format"
            assert refused.value.body["code"] == "unsupported_parameter"
    finally:
        stack.scheduler.stop()


def test_tokens_without_text_at_the_end_still_bring_their_logprobs(tiny_backend) -> None:
    backend = tiny_backend
    special = 3  # a special token (not EOS): no text of its own
    sp = SamplingParams(max_new_tokens=4, temperature=0.0, logit_bias=((special, 100.0),), top_logprobs=0)
    deltas = asyncio.run(deltas_of(backend, tiny_request(backend, "sp", "Hi", sp)))
    assert [(d.text, d.token_ids) for d in deltas] == [("", (special,) * 4)]
    assert [e.token for e in deltas[0].logprobs] == [
        backend.handle.tokenizer.convert_ids_to_tokens(special)
    ] * 4
    sp = SamplingParams(max_new_tokens=4, temperature=0.0, logit_bias=((special, 100.0),))
    assert asyncio.run(deltas_of(backend, tiny_request(backend, "sp2", "Hi", sp))) == []  # as before


@pytest.mark.parametrize("session", ["", "   "])
def test_a_blank_session_header_is_a_400_and_logs_nothing(stack: Stack, client: TestClient, session) -> None:
    """It answered 200 and the store then refused the session id: the user's turn was silently not logged."""

    def turns() -> int:
        return client.get("/v1/memories/turns", params={"user_id": "alice"}, headers=ALICE).json()["total"]

    body = {"model": MODEL, "messages": [{"role": "user", "content": "I adopted a cat named Tom."}]}
    assert (
        client.post("/v1/chat/completions", json=body, headers={**ALICE, "X-Session-Id": "s1"}).status_code
        == 200
    )
    wait_for(lambda: turns() == 2, "the turns to be logged")  # the user's and the reply, after it
    r = client.post("/v1/chat/completions", json=body, headers={**ALICE, "X-Session-Id": session})
    assert r.status_code == 400 and r.json()["error"]["param"] == "x-session-id"
    assert turns() == 2


@pytest.mark.parametrize(
    "extra", [{"temperature": 1e-300}, {"temperature": 1e-40}, {"temperature": 1.0, "top_p": 1e-300}]
)
def test_a_temperature_or_top_p_too_small_for_float32_draws_the_likeliest_token(extra) -> None:
    """logits / 1e-300 overflowed and a top_p that rounds to 0 kept no token: torch.multinomial raised (a 500)."""
    import torch

    from kvmem.kv.sampling import draw

    logits = torch.tensor([0.5, 3.0, -1.0, float("-inf")])
    sampling = Sampling(max_new_tokens=1, **extra)
    for seed in range(5):
        assert int(draw(logits, sampling, torch.Generator().manual_seed(seed))) == 1

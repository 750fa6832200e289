"""OpenAI's logit adjustments and log-probabilities in the decode loop (kvmem/kv/decode.py `Sampling`):
logit_bias, presence and frequency penalties against a reference that applies the same adjustment to the
model's own logits step by step; logprobs are the log_softmax of those logits, top_logprobs their top k; in the
engine's steps (serving/engine), prefill chunks and decode rows together, each request gets the tokens it gets
alone, with or without the parameters."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from kvmem.kv import PromptLayout, Sampling, generate
from kvmem.kv.decode import GenerationStats
from tests.serving.engine.test_engine import make_pool, run_engine


def prompt(tokenizer, text: str) -> list[int]:
    return PromptLayout(tokenizer).prompt([], [], [{"role": "user", "content": text}]).ids


def reference(model, ids, n, *, bias=None, presence=0.0, frequency=0.0):
    """Greedy tokens and each step's adjusted logits [vocab], from a full forward of prompt + tokens so far."""
    tokens, steps = [], []
    for _ in range(n):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([list(ids) + tokens])).logits[0, -1].float().clone()
        for t, b in (bias or {}).items():
            logits[t] += b
        for t, c in Counter(tokens).items():
            logits[t] -= presence * (c > 0) + frequency * c
        steps.append(logits)
        tokens.append(int(torch.argmax(logits)))
    return tokens, steps


def run(model, ids, sampling) -> GenerationStats:
    stats = GenerationStats()
    list(generate(model, ids, sampling=sampling, stats=stats))
    return stats


def test_logit_bias_100_makes_greedy_pick_the_token_at_every_step(tiny_handle, tokenizer):
    model, ids = tiny_handle.model, prompt(tokenizer, "Where do I live?")
    plain = run(model, ids, Sampling(max_new_tokens=8)).token_ids
    t = next(i for i in range(1000, 2000) if i not in plain)  # a token greedy does not pick unbiased
    biased = run(model, ids, Sampling(max_new_tokens=8, logit_bias=((t, 100.0),)))
    assert biased.token_ids == [t] * 8
    # a -100 bias on greedy's first choice moves it off it, as the reference does
    tokens, _ = reference(model, ids, 8, bias={plain[0]: -100.0})
    assert run(model, ids, Sampling(max_new_tokens=8, logit_bias=((plain[0], -100.0),))).token_ids == tokens
    assert tokens[0] != plain[0]


@pytest.mark.parametrize(("presence", "frequency"), [(0.0, 2.0), (2.0, 0.0), (1.5, -0.5), (0.0, 0.0)])
def test_penalties_equal_the_reference_step_by_step(tiny_handle, tokenizer, presence, frequency):
    model, ids = tiny_handle.model, prompt(tokenizer, "Tell me about my cooking.")
    sampling = Sampling(max_new_tokens=24, presence_penalty=presence, frequency_penalty=frequency)
    tokens, _ = reference(model, ids, 24, presence=presence, frequency=frequency)
    assert run(model, ids, sampling).token_ids == tokens
    if (presence, frequency) == (0.0, 0.0):  # no adjustment: exactly today's greedy output
        assert tokens == run(model, ids, Sampling(max_new_tokens=24)).token_ids


def test_a_large_frequency_penalty_stops_repeats(tiny_handle, tokenizer):
    model, ids = tiny_handle.model, prompt(tokenizer, "Hi")
    bias = {t: 100.0 for t in range(3, 9)}  # six tokens 100 above the rest: unpenalised, one repeats
    repeated = run(model, ids, Sampling(max_new_tokens=18, logit_bias=tuple(bias.items()))).token_ids
    assert max(Counter(repeated).values()) >= 6
    sampling = Sampling(max_new_tokens=18, frequency_penalty=2.0, logit_bias=tuple(bias.items()))
    tokens, steps = reference(model, ids, 18, bias=bias, frequency=2.0)
    assert run(model, ids, sampling).token_ids == tokens
    assert set(tokens) <= set(bias) and max(Counter(tokens).values()) < max(Counter(repeated).values())
    # each use costs 2: a token is picked again only while its logit, less its costs, beats every other's
    for token, logits in zip(tokens, steps, strict=True):
        assert all(logits[token] >= logits[t] for t in bias)


def test_logprobs_are_the_log_softmax_of_the_adjusted_logits_and_top_k(tiny_handle, tokenizer):
    model, ids = tiny_handle.model, prompt(tokenizer, "Which city did I mention?")
    bias = {500: 3.0}
    sampling = Sampling(
        max_new_tokens=10, top_logprobs=5, logit_bias=tuple(bias.items()), presence_penalty=0.7
    )
    stats = run(model, ids, sampling)
    tokens, steps = reference(model, ids, 10, bias=bias, presence=0.7)
    assert stats.token_ids == tokens and len(stats.logprobs) == 10
    for lp, token, logits in zip(stats.logprobs, tokens, steps, strict=True):
        expected = torch.log_softmax(logits, dim=-1)
        assert lp.token_id == token
        assert lp.logprob == pytest.approx(float(expected[token]), abs=1e-5)
        top = torch.topk(expected, 5)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-5)
        assert lp.top[0][0] == token  # greedy picks the most likely
    assert run(model, ids, Sampling(max_new_tokens=3, top_logprobs=0)).logprobs[0].top == ()
    assert run(model, ids, Sampling(max_new_tokens=3)).logprobs == []


def test_sampling_validates_the_new_fields():
    with pytest.raises(ValueError, match="presence_penalty"):
        Sampling(presence_penalty=2.5)
    with pytest.raises(ValueError, match="frequency_penalty"):
        Sampling(frequency_penalty=-3.0)
    with pytest.raises(ValueError, match="logit_bias"):
        Sampling(logit_bias=((5, 101.0),))
    with pytest.raises(ValueError, match="top_logprobs"):
        Sampling(top_logprobs=21)


def samplings_mixed() -> list[Sampling]:
    return [
        Sampling(max_new_tokens=9),
        Sampling(max_new_tokens=9, logit_bias=((1234, 100.0),), top_logprobs=2),
        Sampling(max_new_tokens=9, frequency_penalty=2.0, presence_penalty=1.0),
        Sampling(max_new_tokens=9, top_logprobs=3),
    ]


def alone(model, pool, ids, sampling) -> GenerationStats:
    seqs, errors = run_engine(model, pool, [(ids, None)], [sampling], [0])
    assert errors == []
    seqs[0].release()
    return seqs[0].stats


@pytest.mark.parametrize("arrive_at", [[0, 0, 0, 0], [0, 1, 1, 2]], ids=["together", "prefills with decodes"])
def test_batched_requests_with_and_without_the_parameters_get_their_tokens_alone(
    tiny_handle, tokenizer, arrive_at
):
    model = tiny_handle.model
    pool = make_pool(model)
    texts = ["Hi", "Where do I live?", "Tell me what you think of this.", "What did I cook on Tuesday?"]
    requests = [prompt(tokenizer, t) for t in texts]
    samplings = samplings_mixed()
    solo = [alone(model, pool, ids, sp) for ids, sp in zip(requests, samplings, strict=True)]
    seqs, errors = run_engine(model, pool, [(ids, None) for ids in requests], samplings, arrive_at, chunk=4)
    assert errors == []
    assert [s.stats.token_ids for s in seqs] == [s.token_ids for s in solo]
    assert seqs[1].stats.token_ids == [1234] * 9
    for s, one in zip(seqs, solo, strict=True):
        assert [lp.token_id for lp in s.stats.logprobs] == [lp.token_id for lp in one.logprobs]
        for a, b in zip(s.stats.logprobs, one.logprobs, strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
    assert [len(s.stats.logprobs) for s in seqs] == [0, 9, 0, 9]

"""The structured-output mask (serving/engine/grammar.py's `mask`) on the step's logits wherever they are: on
the host, and on a CUDA device (the bitmask is filled on the host and copied to the logits' device; xgrammar
refuses a pair on two devices). A constrained row's logits are -inf exactly where its matcher allows no token,
and kept where it does; a row without a matcher is untouched. The CUDA case runs on the GPU suite's card
(benchmarks/gpu/gpu_suite.sh, graphs_test) with Triton's kernel and with torch's ops. And the closing near a
budget (`Matcher.take`): a reply that completes within its budget keeps every token it chose; one that runs
into it has the token that would leave no room for its closing replaced by the closing."""

from __future__ import annotations

import json

import pytest
import torch

from serving.engine import grammar

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


def masked(tiny_handle, device: str) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Three rows of seeded logits on `device`, the middle one masked by a matcher after '{"n":'; returns
    (the logits before, after, the tokens the matcher allows)."""
    tok = tiny_handle.tokenizer
    vocab = tiny_handle.model.config.vocab_size
    grammars = grammar.Grammars(tok, vocab, [tok.eos_token_id])
    matcher = grammars.compile("json_schema", json.dumps(SCHEMA)).matcher()
    for t in tok.encode('{"n":', add_special_tokens=False):
        assert matcher.accept(t)
    import xgrammar as xgr

    bits = xgr.allocate_token_bitmask(1, vocab)
    matcher.fill(bits, 0)
    allowed = [t for t in range(vocab) if (int(bits[0, t // 32]) >> (t % 32)) & 1]
    before = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0)).to(device)
    after = before.clone()
    grammar.mask(after, [(1, matcher)])
    return before.cpu(), after.cpu(), allowed


def check(before: torch.Tensor, after: torch.Tensor, allowed: list[int]) -> None:
    assert 0 < len(allowed) < before.shape[1]  # digits and a minus sign: a real mask
    assert torch.equal(after[0], before[0]) and torch.equal(after[2], before[2])
    kept = torch.zeros(before.shape[1], dtype=torch.bool)
    kept[allowed] = True
    assert torch.equal(after[1][kept], before[1][kept])
    assert bool(torch.isneginf(after[1][~kept]).all())


def test_on_the_host_a_constrained_rows_logits_are_masked_to_its_matchers_tokens(tiny_handle):
    check(*masked(tiny_handle, "cpu"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("triton", [True, False], ids=["triton", "torch_ops"])
def test_on_cuda_the_mask_is_applied_on_the_logits_device(tiny_handle, monkeypatch, triton):
    if not triton:
        monkeypatch.setattr(grammar, "_has_triton", lambda: False)
    check(*masked(tiny_handle, "cuda"))


def matcher_and_ids(tiny_handle, text: str):
    tok = tiny_handle.tokenizer
    grammars = grammar.Grammars(tok, tiny_handle.model.config.vocab_size, [tok.eos_token_id])
    matcher = grammars.compile("json_schema", json.dumps(SCHEMA)).matcher()
    return matcher, tok.encode(text, add_special_tokens=False)


def test_a_reply_that_completes_within_its_budget_keeps_every_token_it_chose(tiny_handle):
    matcher, ids = matcher_and_ids(tiny_handle, '{"n":123456}')
    budget = len(ids) + 1  # the document and a stop token: every token is within CLOSE_WINDOW of the end
    assert budget <= grammar.CLOSE_WINDOW
    taken = [matcher.take(t, budget - i) for i, t in enumerate(ids)]
    assert taken == ids and not matcher.closed_early
    assert matcher.closing_tokens() == []  # complete: only a stop token is left


def test_a_reply_that_runs_into_its_budget_is_closed_where_its_next_token_would_leave_no_room(tiny_handle):
    matcher, ids = matcher_and_ids(tiny_handle, '{"n":123456}')
    budget = len(ids) - 3  # the digits run on: the object must close before the budget ends
    taken = [matcher.take(t, budget - i) for i, t in enumerate(ids[:budget])]
    tok = tiny_handle.tokenizer
    close = tok.encode("}", add_special_tokens=False)
    assert taken == ids[: budget - len(close)] + close and matcher.closed_early
    reply = json.loads(tok.decode(taken))
    assert reply == {"n": int(tok.decode(ids[: budget - len(close)])[len('{"n":') :])}


def test_a_complete_document_that_the_model_would_extend_past_its_budget_stops(tiny_handle):
    tok = tiny_handle.tokenizer
    grammars = grammar.Grammars(tok, tiny_handle.model.config.vocab_size, [tok.eos_token_id])
    matcher = grammars.compile("json_schema", json.dumps({"type": "number"})).matcher()
    ids = tok.encode("12.", add_special_tokens=False)  # "12" is complete; "12." is not, and 1 token is left
    assert len(ids) == 3
    taken = [matcher.take(t, 3 - i) for i, t in enumerate(ids)]
    assert taken == [*ids[:2], tok.eos_token_id] and matcher.closed_early and matcher.terminated


def test_a_schema_whose_grammar_allows_no_first_token_is_refused_when_it_is_compiled(tiny_handle):
    """`{"$ref": "#"}` compiled, then failed the step at its first token: a 500, and the step it shared was
    run again with the other rows' matchers already advanced (a reply lost its opening brace)."""
    tok = tiny_handle.tokenizer
    grammars = grammar.Grammars(tok, tiny_handle.model.config.vocab_size, [tok.eos_token_id])
    with pytest.raises(grammar.GrammarError, match="admits no JSON document"):
        grammars.compile("json_schema", json.dumps({"$ref": "#"}))
    assert grammars.compile("json_schema", json.dumps(SCHEMA)).matcher() is not None


class DeadEnd:
    """A matcher that allows no token (a grammar that dead-ends after its start)."""

    def fill(self, bitmask, row):
        bitmask[row] = 0

    def take(self, token, remaining=None):
        raise AssertionError("a dead row takes no token")


def test_a_row_whose_grammar_allows_nothing_fails_the_step_before_any_other_row_takes_a_token(tiny_handle):
    from types import SimpleNamespace

    import xgrammar as xgr

    from kvmem.kv import Sampling
    from serving.engine import sampler

    matcher, ids = matcher_and_ids(tiny_handle, '{"n":')
    for t in ids:
        assert matcher.accept(t)
    vocab = tiny_handle.model.config.vocab_size

    def allowed():
        bits = xgr.allocate_token_bitmask(1, vocab)
        matcher.fill(bits, 0)
        return bits.clone()

    before = allowed()

    def row(m):
        stats = SimpleNamespace(token_ids=[], logprobs=[])
        return SimpleNamespace(sampling=Sampling(max_new_tokens=8), generator=None, stats=stats, grammar=m)

    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match="allows no token after 0"):
        sampler.sample(logits, [row(matcher), row(DeadEnd())])
    assert torch.equal(allowed(), before)  # the live row's matcher took nothing: its step can run again
    [token] = sampler.sample(logits[:1].clone(), [row(matcher)])
    assert tiny_handle.tokenizer.decode([token])[:1] in set("-0123456789")  # an integer goes on

"""Every row's next token from one step's logits, with one host sync for the whole step.

Rows are grouped by what they need: greedy rows with no bias, penalty or logprobs take one `argmax` over
all of them; every other row is adjusted (logit_bias, penalties) and drawn as a tensor (temperature, top-p,
its own seeded generator), never read back alone: kvmem/kv/sampling.py's functions, the one place sampling is
written. The tokens of all rows are read with one `.tolist()`.
Log-probabilities, asked for by few requests, are computed after it from the adjusted logits.
A row whose sequence has a grammar (a response format: grammar.py) first has every token its grammar does not
allow next set to -inf, in place, and its matcher takes the chosen token after the sync (near its budget the
token can give way to its JSON's closing: grammar.py); other rows are as without it.

What a seed guarantees: the same request run alone gives the same tokens every time (its generator draws
from the same distribution). In a batch the logits come from other matrix-kernel shapes, equal to within
rounding, so a draw that lands within that rounding of a boundary between two tokens can differ; OpenAI
documents `seed` as best effort in the same sense.
"""

from __future__ import annotations

import torch

from kvmem.kv.sampling import adjust_logits, draw, token_logprobs
from serving.engine import grammar


def sample(logits: torch.Tensor, seqs: list) -> list[int]:
    """logits: [rows, vocab] float32, the step's own copy (masked rows change in place), row i for seqs[i]
    (each with .sampling, .generator, .stats and .grammar: a grammar.Matcher or None)."""
    rows = logits.shape[0]
    constrained = [(i, s.grammar) for i, s in enumerate(seqs) if s.grammar is not None]
    if constrained:
        dead = grammar.mask(logits, constrained)
        if dead:  # raised before any matcher takes a token: run alone, every other row goes on unchanged
            raise RuntimeError(
                f"the response format's grammar allows no token after {len(seqs[dead[0]].stats.token_ids)}"
            )
    plain = [i for i, s in enumerate(seqs) if s.sampling.temperature == 0.0 and not _special(s.sampling)]
    picks: list[torch.Tensor | None] = [None] * rows
    if plain:
        idx = torch.tensor(plain, device=logits.device)
        for i, t in zip(plain, torch.argmax(logits[idx], dim=-1).split(1), strict=True):
            picks[i] = t
    adjusted: dict[int, torch.Tensor] = {}
    for i, s in enumerate(seqs):
        if picks[i] is not None:
            continue
        row = logits[i]
        if s.sampling.adjusts_logits:
            row = adjust_logits(row, s.sampling, s.stats.token_ids)
        adjusted[i] = row
        if s.sampling.temperature == 0.0:
            picks[i] = torch.argmax(row).reshape(1)
        else:
            picks[i] = draw(row, s.sampling, s.generator).reshape(1)
    tokens = torch.cat(picks).tolist()  # the step's one host sync
    for i, matcher in constrained:  # near its budget a row's token can give way to its JSON's closing
        taken = matcher.take(tokens[i], seqs[i].sampling.max_new_tokens - len(seqs[i].stats.token_ids))
        if taken is None:  # not reached: a row whose every token is masked is refused above
            raise RuntimeError(
                f"the response format's grammar allows no token after {len(seqs[i].stats.token_ids)}"
            )
        tokens[i] = taken
    for i, row in adjusted.items():
        s = seqs[i]
        if s.sampling.top_logprobs is not None:
            s.stats.logprobs.append(token_logprobs(row, tokens[i], s.sampling.top_logprobs))
    return tokens


def _special(sampling) -> bool:
    return sampling.adjusts_logits or sampling.top_logprobs is not None

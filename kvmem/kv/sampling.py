"""How a next token is chosen from a model's logits: the sampling parameters (OpenAI's, validated), the
logit adjustments (bias, presence and frequency penalties), the temperature and top-p draw, and the
log-probabilities recorded. Written once: the engine's batched sampler (serving/engine/sampler.py) and the
reference decode loop (decode.py) both call these. Knows nothing of caches, batches or HTTP.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

MAX_TOP_LOGPROBS = 20  # as OpenAI


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen from the model's logits, in this order: logit_bias and the penalties are
    added to the logits (OpenAI's semantics: logits[t] += bias[t] - presence_penalty * (count[t] > 0) -
    frequency_penalty * count[t], count[t] = times t was generated so far, the prompt not counted); then
    greedy (temperature 0) or temperature and top-p sampling. `top_logprobs` None records no log-probabilities;
    k in 0..20 records the chosen token's and the k most likely tokens' log_softmax of the adjusted logits
    (before temperature and top-p) in `GenerationStats.logprobs`. With no bias and no penalty the logits are
    used as the model gave them (greedy output is unchanged bit for bit)."""

    max_new_tokens: int = 32
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None
    presence_penalty: float = 0.0  # in [-2, 2]
    frequency_penalty: float = 0.0  # in [-2, 2]
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100])
    top_logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        for token, bias in self.logit_bias:
            if token < 0 or not -100.0 <= bias <= 100.0:
                raise ValueError(
                    f"logit_bias needs token ids >= 0 and biases in [-100, 100], got {token}: {bias}"
                )
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(
                f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}] or None, got {self.top_logprobs}"
            )

    @property
    def adjusts_logits(self) -> bool:
        return bool(self.logit_bias) or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


class TokenLogprobs(NamedTuple):
    """One generated token's log-probability and the `top` most likely (token id, log-probability), best first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass
class GenerationStats:
    """Filled in as generation proceeds; read it after the iterator is exhausted (or after the first token)."""

    prompt_tokens: int = 0
    reused_tokens: int = 0
    prefilled_tokens: int = 0
    ttft_s: float | None = None
    finish_reason: str | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(
        default_factory=list
    )  # one per token when sampling.top_logprobs is set


def adjust_logits(logits: torch.Tensor, sampling: Sampling, generated: Sequence[int]) -> torch.Tensor:
    """logits [vocab] float32 with the logit bias and the presence and frequency penalties of `generated` (the
    tokens produced so far) applied; a new tensor (the input may be an inference tensor shared by a batch)."""
    out = logits.clone()
    if sampling.logit_bias:
        ids = torch.tensor([t for t, _ in sampling.logit_bias], dtype=torch.long, device=logits.device)
        bias = torch.tensor([b for _, b in sampling.logit_bias], dtype=out.dtype, device=logits.device)
        out.index_add_(0, ids, bias)
    if generated and (sampling.presence_penalty or sampling.frequency_penalty):
        ids = torch.tensor(list(generated), dtype=torch.long, device=logits.device)
        counts = torch.bincount(ids, minlength=out.shape[-1])[: out.shape[-1]].to(out.dtype)  # [vocab]
        out -= sampling.presence_penalty * (counts > 0).to(out.dtype) + sampling.frequency_penalty * counts
    return out


def token_logprobs(logits: torch.Tensor, token: int, k: int) -> TokenLogprobs:
    """The log_softmax of logits [vocab] at `token` and its k largest entries, largest first."""
    logp = torch.log_softmax(logits, dim=-1)
    top = torch.topk(logp, k) if k else None
    pairs = () if top is None else tuple(zip(top.indices.tolist(), top.values.tolist(), strict=True))
    return TokenLogprobs(token, float(logp[token].item()), pairs)


# the smallest temperature divided by: finite logits over it stay finite in float32 (|logit| < 3e8)
MIN_TEMPERATURE = 1e-30


def draw(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> torch.Tensor:
    """A token id drawn from logits [vocab] float32 at the sampling's temperature (> 0) and top-p, as a 1-element
    tensor (no host sync, so a batch reads all its rows' tokens at once)."""
    # a temperature so small that logits / it overflow float32 (1e-300) draws the argmax, as it tends to
    probs = torch.softmax(logits / max(sampling.temperature, MIN_TEMPERATURE), dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < sampling.top_p
        keep[..., 0] = True  # the likeliest token always (a top_p that rounds to 0 in float32 kept none)
        sorted_probs = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
        choice = torch.multinomial(sorted_probs / sorted_probs.sum(), 1, generator=generator)
        return order[choice]
    return torch.multinomial(probs, 1, generator=generator)


def pick(
    logits: torch.Tensor,
    sampling: Sampling,
    generator: torch.Generator | None,
    stats: GenerationStats | None = None,
) -> int:
    """One row's next token from logits [vocab] float32: adjusted (bias, penalties), then greedy or drawn.
    `stats` holds the tokens generated so far (the penalties count them) and receives the chosen token's
    log-probabilities when the sampling asks for them."""
    if sampling.adjusts_logits:
        logits = adjust_logits(logits, sampling, stats.token_ids if stats is not None else ())
    if sampling.temperature == 0.0:
        token = int(torch.argmax(logits).item())
    else:
        token = int(draw(logits, sampling, generator).item())
    if sampling.top_logprobs is not None and stats is not None:
        stats.logprobs.append(token_logprobs(logits, token, sampling.top_logprobs))
    return token

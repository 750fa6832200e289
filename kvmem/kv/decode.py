"""A minimal token-by-token generation loop over a (possibly injected) cache.

Owns prefill of what the cache does not cover, sampling (greedy, temperature, top-p, seeded, OpenAI's presence
and frequency penalties and logit bias, log-probabilities), stop on EOS, max tokens or a caller's cancel check,
and the timing of the first token. Knows nothing of HTTP or tiers.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from transformers import DynamicCache

from kvmem.kv.inject import Injection, inject
from kvmem.kv.item import KVItem

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


def eos_token_ids(model: torch.nn.Module, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), tokenizer):
        eos = getattr(src, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
    return frozenset(ids)


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


def _pick(
    logits: torch.Tensor,
    sampling: Sampling,
    generator: torch.Generator | None,
    stats: GenerationStats | None = None,
) -> int:
    """logits: [vocab] float32. `stats` holds the tokens generated so far (the penalties count them) and
    receives the chosen token's log-probabilities when the sampling asks for them."""
    if sampling.adjusts_logits:
        logits = adjust_logits(logits, sampling, stats.token_ids if stats is not None else ())
    token = _choose(logits, sampling, generator)
    if sampling.top_logprobs is not None and stats is not None:
        stats.logprobs.append(token_logprobs(logits, token, sampling.top_logprobs))
    return token


def _choose(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
    if sampling.temperature == 0.0:
        return int(torch.argmax(logits).item())
    probs = torch.softmax(logits / sampling.temperature, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < sampling.top_p
        sorted_probs = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
        choice = torch.multinomial(sorted_probs / sorted_probs.sum(), 1, generator=generator)
        return int(order[choice].item())
    return int(torch.multinomial(probs, 1, generator=generator).item())


def generate(
    model: torch.nn.Module,
    prompt_ids: list[int] | tuple[int, ...],
    *,
    item: KVItem | None = None,
    prefix: Injection | None = None,
    sampling: Sampling = Sampling(),
    stop_token_ids: frozenset[int] = frozenset(),
    should_stop: Callable[[], bool] | None = None,
    stats: GenerationStats | None = None,
) -> Iterator[int]:
    """Yield generated token ids. With `item`, its K/V covers the prompt's common prefix (zero-copy). With
    `prefix` instead (a cache the caller made, e.g. a live session's: serving/engine/sessions.py), its cache covers
    the prompt's first `reused_tokens`; the caller keeps it, holding every token fed, after the last yield."""
    stats = stats if stats is not None else GenerationStats()
    stats.prompt_tokens = len(prompt_ids)
    device = next(model.parameters()).device
    generator = None
    if sampling.temperature > 0 and sampling.seed is not None:
        generator = torch.Generator(device=device).manual_seed(sampling.seed)
    start = time.perf_counter()
    if prefix is not None:
        cache, reused = prefix.cache, prefix.reused_tokens
    elif item is not None:
        injection = inject(item, prompt_ids)
        cache, reused = injection.cache, injection.reused_tokens
    else:
        cache, reused = DynamicCache(), 0
    stats.reused_tokens, stats.prefilled_tokens = reused, len(prompt_ids) - reused
    position = reused
    next_ids = list(prompt_ids[reused:])
    for step in range(sampling.max_new_tokens):
        # Inference mode is entered and left inside each step, never held across the `yield`: the model thread
        # interleaves many of these generators, and a mode held across a yield is restored in whatever order
        # the generators end, so one request finishing would switch it off for the others (and their forwards
        # would build autograd graphs through the cache). Every input is made under inference mode, so a
        # compiled model sees one kind of tensor and does not recompile between the prefill and decode steps.
        with torch.inference_mode():
            next_input = torch.tensor([next_ids], dtype=torch.long, device=device)
            n = next_input.shape[1]
            cache_position = torch.arange(position, position + n, device=device)
            out = model(
                input_ids=next_input,
                past_key_values=cache,
                use_cache=True,
                cache_position=cache_position,
                logits_to_keep=1,
            )
            token = _pick(out.logits[0, -1].float(), sampling, generator, stats)
            del out
        if step == 0:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            stats.ttft_s = time.perf_counter() - start
        position += n
        stats.token_ids.append(token)
        yield token
        if token in stop_token_ids:
            stats.finish_reason = "stop"
            return
        if should_stop is not None and should_stop():
            stats.finish_reason = "cancelled"
            return
        next_ids = [token]
    stats.finish_reason = "length"

"""A minimal token-by-token generation loop over a (possibly injected) cache.

Owns prefill of what the cache does not cover, stop on EOS, max tokens or a caller's cancel check, and the
timing of the first token; each token is chosen by sampling.py's `pick`, the sampling the engine uses too.
Knows nothing of HTTP or tiers.

This loop is the reference the engine is checked against, not a second engine: the exactness invariant is
"greedy tokens with injected KV equal a full prefill's", and the tests compare the engine's paged, batched
steps with this plain one-request loop over transformers' own cache (a check of the engine against itself
would prove nothing). The distillation gates (scheduler/distill) decode with it too: they run under the
scheduler, which may not import serving, on a peft model being trained in the distill job's own process,
not on the served model in the engine's model thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import torch
from transformers import DynamicCache

from kvmem.kv.inject import Injection, inject
from kvmem.kv.item import KVItem
from kvmem.kv.sampling import (  # re-exported: callers import them from here or from kvmem.kv
    MAX_TOP_LOGPROBS,
    GenerationStats,
    Sampling,
    TokenLogprobs,
    adjust_logits,
    pick,
    token_logprobs,
)

__all__ = [
    "MAX_TOP_LOGPROBS",
    "GenerationStats",
    "Sampling",
    "TokenLogprobs",
    "adjust_logits",
    "eos_token_ids",
    "generate",
    "pick",
    "token_logprobs",
]

DEFAULT_SAMPLING = Sampling()  # greedy, 32 tokens


def eos_token_ids(model: torch.nn.Module, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), tokenizer):
        eos = getattr(src, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
    return frozenset(ids)


def generate(
    model: torch.nn.Module,
    prompt_ids: list[int] | tuple[int, ...],
    *,
    item: KVItem | None = None,
    prefix: Injection | None = None,
    sampling: Sampling = DEFAULT_SAMPLING,
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
            token = pick(out.logits[0, -1].float(), sampling, generator, stats)
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

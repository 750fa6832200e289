"""Batched decode: many requests' next tokens from one forward, each request with its own cache.

A `CacheSequence` is one request's generation state (its own cache, which may start as views of an injected KV
item, its position, sampling and seeded generator). Its prompt is prefilled alone, in chunks of a fixed size
counted from the start of the prefill, so a long prompt never holds the model for its whole length and the
chunk boundaries never depend on what else is running. `decode_step` then runs the decode step of every
sequence as one forward: the linear layers see a batch, attention is ragged (each row attends to its own
cache with exactly the call it would make alone: no padding, no mask), so a sequence's attention does not
depend on its neighbours. Knows nothing of HTTP, threads or tiers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from collections.abc import Sequence as Seq

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer
from transformers.modeling_utils import AttentionInterface

from benchmarks.engine.percache.grow import append
from kvmem.kv.inject import Injection, inject
from kvmem.kv.item import KVItem
from kvmem.kv.sampling import GenerationStats, Sampling, pick
from serving.engine.sequence import EngineSequence, SequenceError

log = logging.getLogger(__name__)

RAGGED = "kvmem_ragged"  # the attention implementation a batched decode forward runs under


class CacheSequence(EngineSequence):
    """One request's tokens, produced by `prefill_step` (alone) and then `decode_step` (batched with others),
    over a cache of its own instead of the engine's pages (its `table` is None). Lifecycle, sampling, chunks
    and stats are the engine's EngineSequence's (serving/engine/sequence.py).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        prompt_ids: Seq[int],
        *,
        item: KVItem | None = None,
        injection: Injection | None = None,
        sampling: Sampling | None = None,
        stop_token_ids: frozenset[int] = frozenset(),
        should_stop: Callable[[], bool] | None = None,
        stats: GenerationStats | None = None,
        prefill_chunk_tokens: int | None = None,
    ) -> None:
        if injection is None and item is not None and prompt_ids:
            injection = inject(item, prompt_ids)
        super().__init__(
            model,
            prompt_ids,
            table=None,
            reused=injection.reused_tokens if injection is not None else 0,
            sampling=sampling,
            stop_token_ids=stop_token_ids,
            should_stop=should_stop,
            stats=stats,
            prefill_chunk_tokens=prefill_chunk_tokens,
        )
        self.cache = injection.cache if injection is not None else DynamicCache()

    @property
    def batchable(self) -> bool:
        """A seeded sampled sequence decodes alone: a batch computes its logits with other matrix kernels
        (the same values to within rounding), and a draw near a boundary of the distribution can flip on the
        last bit; alone, its tokens are bit for bit those of the same request run alone, whatever else runs."""
        return not (self.sampling.temperature > 0 and self.sampling.seed is not None)

    def prefill_step(self) -> int | None:
        """Run the next prefill chunk alone; the first generated token once the prompt is all in the cache."""
        assert self.prefilling, "prefill_step on a sequence that is not prefilling"
        n = self.next_chunk_tokens()
        ids, self._prefill = self._prefill[:n], self._prefill[n:]
        with torch.inference_mode():  # per step, never held across a yield (see decode.generate)
            out = self.model(
                input_ids=torch.tensor([ids], dtype=torch.long, device=self.device),
                past_key_values=self.cache,
                use_cache=True,
                cache_position=torch.arange(self.position, self.position + n, device=self.device),
                logits_to_keep=1,
            )
            token = (
                None
                if self._prefill
                else pick(out.logits[0, -1].float(), self.sampling, self.generator, self.stats)
            )
            del out
        self.position += n
        if token is not None:
            self._accept(token)
        return token


def _append(cache: DynamicCache, keys: torch.Tensor, values: torch.Tensor, layer_idx: int):
    """cache.update(keys, values, layer_idx), into the layer's spare room when it has some (grow.py)."""
    if layer_idx < len(cache.layers) and type(cache.layers[layer_idx]) is DynamicLayer:
        return append(cache.layers[layer_idx], keys, values)
    return cache.update(keys, values, layer_idx)


class _RaggedCache(Cache):
    """The `past_key_values` of a batched decode forward: row i of each update goes into sequence i's own
    cache (the same concatenation it would do alone); the attention below reads each row's full K/V back."""

    def __init__(self, caches: list[DynamicCache]) -> None:
        super().__init__(layers=[])
        self.caches = caches
        self.rows: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.rows[layer_idx] = [
            _append(cache, key_states[i : i + 1], value_states[i : i + 1], layer_idx)
            for i, cache in enumerate(self.caches)
        ]
        return key_states, value_states  # unused: the ragged attention reads self.rows

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions are always passed explicitly

    @property
    def is_sliding(self) -> list[bool]:
        return [False]


def _ragged_attention(module, query, key, value, attention_mask, *, kvmem_rows: _RaggedCache, **kwargs):
    """Each row's query attends to its own sequence's K/V through the call it would make alone."""
    rows = kvmem_rows.rows[module.layer_idx]
    outs = [
        kvmem_rows.attention(module, query[i : i + 1], k, v, None, **kwargs)[0]
        for i, (k, v) in enumerate(rows)
    ]
    return torch.cat(outs, dim=0), None


AttentionInterface.register(RAGGED, _ragged_attention)


def can_batch(model: torch.nn.Module) -> bool:
    """Ragged batching assumes full causal attention in every layer (each row attends to all its cache) and
    the decode step of a row needs no mask alone: true for sdpa, not for sliding-window models."""
    config = model.config.get_text_config()
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return False
    if set(getattr(config, "layer_types", None) or ["full_attention"]) != {"full_attention"}:
        return False
    return model.config._attn_implementation == "sdpa"


def _forward_one(seq: CacheSequence) -> torch.Tensor:
    """A decode step alone, exactly as decode.generate runs it; the next-token logits [vocab] float32."""
    out = seq.model(
        input_ids=torch.tensor([[seq.last_token]], dtype=torch.long, device=seq.device),
        past_key_values=seq.cache,
        use_cache=True,
        cache_position=torch.arange(seq.position, seq.position + 1, device=seq.device),
        logits_to_keep=1,
    )
    return out.logits[0, -1].float()


def _forward_ragged(model: torch.nn.Module, seqs: list[CacheSequence]) -> torch.Tensor:
    """One forward for every sequence's decode step; logits [batch, vocab] float32."""
    device = seqs[0].device
    rows = _RaggedCache([s.cache for s in seqs])
    config = model.config
    alone = config._attn_implementation
    rows.attention = AttentionInterface._global_mapping[alone]
    config._attn_implementation = RAGGED
    try:
        out = model(
            input_ids=torch.tensor([[s.last_token] for s in seqs], dtype=torch.long, device=device),
            position_ids=torch.tensor([[s.position] for s in seqs], dtype=torch.long, device=device),
            past_key_values=rows,
            use_cache=True,
            logits_to_keep=1,
            kvmem_rows=rows,
        )
    finally:
        config._attn_implementation = alone
    return out.logits[:, -1].float()


def decode_step(model: torch.nn.Module, seqs: list[CacheSequence]) -> list[int | SequenceError]:
    """The next token of every sequence (all decoding), from one forward; each is accepted into its sequence.

    With one sequence (or a model `can_batch` refuses) each runs alone, as does a seeded sampled one. If the batched forward raises, every
    cache is put back as it was and each sequence runs alone, so an error stays with the sequence it belongs
    to: its entry is a `SequenceError` (the sequence is finished, reason "error"); the others go on."""
    assert seqs and all(s.decoding for s in seqs), "decode_step needs decoding sequences"
    results: list[int | SequenceError] = []
    with torch.inference_mode():  # per step, never held across a yield (see decode.generate)
        logits: dict[int, torch.Tensor] = {}  # index in seqs -> logits of its batched row
        batch = [i for i, s in enumerate(seqs) if s.batchable]
        if len(batch) > 1 and can_batch(model):
            saved = [[(layer.keys, layer.values) for layer in seqs[i].cache.layers] for i in batch]
            try:
                logits = dict(zip(batch, _forward_ragged(model, [seqs[i] for i in batch]), strict=True))
            except Exception:  # noqa: BLE001 - isolated below: each sequence is retried alone
                log.warning(
                    "a batched decode step failed; running its %d sequences alone", len(batch), exc_info=True
                )
                for i, layers in zip(batch, saved, strict=True):
                    cache = seqs[i].cache
                    for layer, (k, v) in zip(cache.layers, layers, strict=False):
                        layer.keys, layer.values = k, v
                    del cache.layers[len(layers) :]
        for i, s in enumerate(seqs):
            try:
                row = logits[i] if i in logits else _forward_one(s)
                results.append(pick(row, s.sampling, s.generator, s.stats))
            except Exception as exc:  # noqa: BLE001 - this sequence's error, handed to its caller
                s._finish("error")
                results.append(SequenceError(s, exc))
    for s, token in zip(seqs, results, strict=True):
        if isinstance(token, int):
            s.position += 1
            s._accept(token)
    return results

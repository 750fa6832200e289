"""One forward for a whole step: every decoding sequence's next token and every admitted prefill chunk.

`CacheSequence.prefill_step` runs a chunk alone and `decode_step` a batch of 1-token rows; each prefill forward
reads every weight again for a few dozen tokens. `step` packs them: input_ids [1, T] where T is the decode
rows (1 token each) plus the chunk tokens of each prefilling sequence, each segment with its own positions.
The linear layers see T rows; attention is split by segment, and each segment runs the very call its
sequence would make alone (the model's own attention function, on its own cache): a 1-token decode segment
attends to its whole cache with no mask; a prefill chunk of L tokens whose cache then holds P + L tokens
with the boolean causal mask [1, 1, L, P + L] that transformers builds for it alone (no mask, causal, when
P == 0). Each layer's new K/V are split along the sequence into each sequence's own cache (grow.append). The
logits are computed only at each segment's last position; a chunk that is not its prompt's last yields no
token, as alone. Chunk sizes are each sequence's own (counted from the start of its prefill), so what else
runs never changes them. Outputs agree with each sequence alone to within the rounding of the linear
layers' kernels (other row counts); `benchmarks/engine/batch_agreement.py` measures it.

A seeded sampled sequence, a model `can_batch` refuses, or a step with one segment runs alone as before. If
the packed forward raises, every cache is put back as it was and each sequence runs alone (the old path), so
an error stays with its own sequence.
"""

from __future__ import annotations

import logging

import torch
from transformers.cache_utils import Cache
from transformers.modeling_utils import AttentionInterface

from benchmarks.engine.percache.batch import CacheSequence, SequenceError, _append, can_batch, decode_step
from kvmem.kv.sampling import pick

log = logging.getLogger(__name__)

PACKED = "kvmem_packed"  # the attention implementation a packed forward runs under

Result = int | None | SequenceError  # a token, no token (a chunk before the prompt's last), or its error


class _Segment:
    """One sequence's part of the packed input: tokens [start, start + length), cache holding `past` before."""

    def __init__(self, seq: CacheSequence, ids: list[int], start: int) -> None:
        self.seq, self.ids, self.start = seq, ids, start
        self.length, self.past = len(ids), seq.position
        self.prefill = seq.prefilling
        self.yields = not self.prefill or self.length == len(seq._prefill)  # a token comes out of it

    @property
    def end(self) -> int:
        return self.start + self.length

    def mask(self, device: torch.device) -> torch.Tensor | None:
        """The mask the segment's attention gets alone: None for one token or an empty past (causal), else
        query i sees keys 0 .. past + i (bottom-right aligned), as transformers' sdpa mask for a chunk."""
        if self.length == 1 or self.past == 0:
            return None
        q = torch.arange(self.length, device=device)[:, None]
        k = torch.arange(self.past + self.length, device=device)[None, :]
        return (k <= q + self.past)[None, None]


class _PackedCache(Cache):
    """The `past_key_values` of a packed forward: each segment's positions of a layer's update go into its
    sequence's own cache; the attention below reads each segment's full K/V back from `rows`."""

    def __init__(self, segments: list[_Segment]) -> None:
        super().__init__(layers=[])
        self.segments = segments
        self.rows: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.rows[layer_idx] = [
            _append(
                g.seq.cache, key_states[:, :, g.start : g.end], value_states[:, :, g.start : g.end], layer_idx
            )
            for g in self.segments
        ]
        return key_states, value_states  # unused: the packed attention reads self.rows

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions are always passed explicitly

    @property
    def is_sliding(self) -> list[bool]:
        return [False]


def _packed_attention(module, query, key, value, attention_mask, *, kvmem_packed: _PackedCache, **kwargs):
    """Each segment's queries attend to its own sequence's K/V through the call it would make alone."""
    rows, masks = kvmem_packed.rows[module.layer_idx], kvmem_packed.masks
    outs = [
        kvmem_packed.attention(module, query[:, :, g.start : g.end], k, v, m, **kwargs)[0]
        for g, (k, v), m in zip(kvmem_packed.segments, rows, masks, strict=True)
    ]
    return torch.cat(outs, dim=1), None  # [1, T, heads, dim], as the attention interface returns


AttentionInterface.register(PACKED, _packed_attention)


def _forward_packed(model: torch.nn.Module, segments: list[_Segment]) -> torch.Tensor:
    """One forward of every segment; logits [segments, vocab] float32 at each segment's last position."""
    device = segments[0].seq.device
    ids = [t for g in segments for t in g.ids]
    positions = [p for g in segments for p in range(g.past, g.past + g.length)]
    rows = _PackedCache(segments)
    rows.masks = [g.mask(device) for g in segments]
    config = model.config
    alone = config._attn_implementation
    rows.attention = AttentionInterface._global_mapping[alone]
    config._attn_implementation = PACKED
    try:
        out = model(
            input_ids=torch.tensor([ids], dtype=torch.long, device=device),
            position_ids=torch.tensor([positions], dtype=torch.long, device=device),
            past_key_values=rows,
            use_cache=True,
            logits_to_keep=torch.tensor([g.end - 1 for g in segments], dtype=torch.long, device=device),
            kvmem_packed=rows,
        )
    finally:
        config._attn_implementation = alone
    return out.logits[0].float()


def _alone(
    model: torch.nn.Module, prefills: list[CacheSequence], decodes: list[CacheSequence]
) -> list[Result]:
    """The old path: each chunk by `prefill_step`, then `decode_step` of the decoding sequences."""
    results: list[Result] = []
    for s in prefills:
        try:
            results.append(s.prefill_step())
        except Exception as exc:  # noqa: BLE001 - this sequence's error, handed to its caller
            s._finish("error")
            results.append(SequenceError(s, exc))
    return results + (decode_step(model, decodes) if decodes else [])


def segments_of(seqs: list[CacheSequence]) -> list[_Segment]:
    """Each sequence's segment of a packed input: its next prefill chunk, or its last token."""
    segments, start = [], 0
    for s in seqs:
        ids = s._prefill[: s.next_chunk_tokens()] if s.prefilling else [s.last_token]
        segments.append(_Segment(s, ids, start))
        start += len(ids)
    return segments


def commit(g: _Segment, row: torch.Tensor) -> Result:
    """After the packed forward: the segment's tokens are in its cache; its token (if it yields one) from
    `row`, its logits at its last position, accepted into its sequence."""
    s = g.seq
    try:
        token = pick(row, s.sampling, s.generator, s.stats) if g.yields else None
    except Exception as exc:  # noqa: BLE001 - this sequence's error, handed to its caller
        s._finish("error")
        return SequenceError(s, exc)
    if g.prefill:
        s._prefill = s._prefill[g.length :]
    s.position += g.length
    if token is not None:
        s._accept(token)
    return token


def step(model: torch.nn.Module, prefills: list[CacheSequence], decodes: list[CacheSequence]) -> list[Result]:
    """One prefill chunk of each of `prefills` and one decode step of each of `decodes` (all of `model`),
    packed into one forward where they can be; results in the order prefills + decodes (see the docstring)."""
    assert all(s.prefilling for s in prefills) and all(s.decoding for s in decodes)
    packable = [s for s in prefills + decodes if s.batchable]
    if not prefills or len(packable) < 2 or not can_batch(model):
        return _alone(model, prefills, decodes)
    segments = segments_of(packable)
    saved = [[(layer.keys, layer.values) for layer in g.seq.cache.layers] for g in segments]
    try:
        with torch.inference_mode():  # per step, never held across a yield (see decode.generate)
            logits = _forward_packed(model, segments)
    except Exception:  # noqa: BLE001 - isolated below: each sequence is retried alone
        log.warning("a packed step failed; running its %d sequences alone", len(segments), exc_info=True)
        for g, layers in zip(segments, saved, strict=True):
            cache = g.seq.cache
            for layer, (k, v) in zip(cache.layers, layers, strict=False):
                layer.keys, layer.values = k, v
            del cache.layers[len(layers) :]
        return _alone(model, prefills, decodes)
    with torch.inference_mode():  # the logits are inference tensors: sampling may work on them in place
        results = {g.seq: commit(g, row) for g, row in zip(segments, logits, strict=True)}
    rest = _alone(model, [s for s in prefills if s not in results], [s for s in decodes if s not in results])
    rest_of = dict(zip([s for s in prefills + decodes if s not in results], rest, strict=True))
    return [results[s] if s in results else rest_of[s] for s in prefills + decodes]

"""One forward per step for every row: decode rows and prefill chunks, with one attention call per layer.

The step's tokens are packed into input_ids [1, T] (each sequence's chunk, or its last token), each with its
own position. The linear layers see T rows. In every layer, the attention function registered below:
1. writes the step's new K/V into the pool at each token's slot (its sequence's pages);
2. gathers each sequence's K/V by its page table into [B, Lmax] (pad slots masked out) and its queries into
   [B, Qmax]; one `scaled_dot_product_attention` call for the whole step, with the boolean mask each row
   would have alone (query i of a chunk after P positions sees keys 0 .. P + i), GQA by the kernel;
3. scatters the outputs back to the packed order.
No Python loop over sequences runs inside a layer: the indices and the mask are built once per step. The
logits are computed only at each row's last position, and every row's token comes out of one host sync
(sampler.py). A chunk that is not its prompt's last yields no token, as alone.

Measured alternatives (`benchmarks/engine_bench.py`): FlexAttention with a block mask compiles per shape on
CPU; SDPA over gathered K/V costs one gather per layer, bounded by the step's own tokens.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache
from transformers.modeling_utils import AttentionInterface

from kvmem.kv.batch import SequenceError
from serving.engine import lora, sampler
from serving.engine.pages import PagePool

log = logging.getLogger(__name__)

PAGED = "kvmem_paged"  # the attention implementation a step's forward runs under

Result = int | None | SequenceError


class StepPlan(Cache):
    """The step's indices, built once: where each token's K/V go, what each row reads, and the mask. It is
    passed as `past_key_values` (its `update` leaves K/V to the attention function)."""

    def __init__(self, pool: PagePool, seqs: list, chunks: list[list[int]], device: torch.device) -> None:
        super().__init__(layers=[])
        self.pool = pool
        lengths = [len(c) for c in chunks]
        pasts = [s.position for s in seqs]
        b, qmax = len(seqs), max(lengths)
        kmax = max(p + n for p, n in zip(pasts, lengths, strict=True))
        write, gather, q_index, out_index = [], [], [], []
        start = 0
        for r, (s, n, p) in enumerate(zip(seqs, lengths, pasts, strict=True)):
            write.append(s.table.extend(n, torch.device("cpu")))
            row = pool.slots(s.table.pages, 0, p + n)
            gather.append(F.pad(row, (0, kmax - p - n)))
            q_index.append(F.pad(torch.arange(start, start + n), (0, qmax - n)))
            out_index.append(torch.arange(n) + r * qmax)
            start += n
        self.write = torch.cat(write).to(device)
        self.gather = torch.cat(gather).to(device)  # [B * Kmax] slots, row by row
        self.q_index = torch.cat(q_index).to(device)  # [B * Qmax] packed positions, row by row
        self.out_index = torch.cat(out_index).to(device)  # [T] into [B * Qmax]
        q = torch.arange(qmax)[None, :, None]
        k = torch.arange(kmax)[None, None, :]
        p = torch.tensor(pasts)[:, None, None]
        n = torch.tensor(lengths)[:, None, None]
        mask = (k <= p + q) & (k < p + n)
        mask[:, :, 0] |= q[:, :, 0] >= n[:, :, 0]  # pad query rows see key 0 (discarded; no NaN)
        self.mask = None if bool(mask.all()) else mask[:, None].to(device)
        self.shape = (b, qmax, kmax)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return key_states, value_states  # written by the attention function

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions are passed explicitly

    @property
    def is_sliding(self) -> list[bool]:
        return [False]


def _paged_attention(module, query, key, value, attention_mask, *, kvmem_step: StepPlan, scaling=None, **kw):
    st, layer = kvmem_step, module.layer_idx
    k_pool, v_pool = st.pool.k[layer], st.pool.v[layer]  # [slots, kv_heads, dim]
    k_pool.index_copy_(0, st.write, key[0].transpose(0, 1).to(k_pool.dtype))
    v_pool.index_copy_(0, st.write, value[0].transpose(0, 1).to(v_pool.dtype))
    b, qmax, kmax = st.shape
    k = k_pool.index_select(0, st.gather).view(b, kmax, *k_pool.shape[1:]).transpose(1, 2)  # [B, kv, K, d]
    v = v_pool.index_select(0, st.gather).view(b, kmax, *v_pool.shape[1:]).transpose(1, 2)
    heads, dim = query.shape[1], query.shape[3]
    q = query[0].index_select(1, st.q_index).view(heads, b, qmax, dim).transpose(0, 1)  # [B, heads, Q, d]
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=st.mask, scale=scaling, enable_gqa=heads != k.shape[1]
    )
    out = out.transpose(1, 2).reshape(b * qmax, heads, dim).index_select(0, st.out_index)
    return out.unsqueeze(0), None  # [1, T, heads, dim], as the attention interface returns


AttentionInterface.register(PAGED, _paged_attention)


def forward(model: torch.nn.Module, pool: PagePool, seqs: list, chunks: list[list[int]]) -> torch.Tensor:
    """One forward of every row; logits [rows, vocab] float32 at each row's last position."""
    device = next(model.parameters()).device
    ids = [t for c in chunks for t in c]
    positions = [p for s, c in zip(seqs, chunks, strict=True) for p in range(s.position, s.position + len(c))]
    ends, end = [], 0
    for c in chunks:
        end += len(c)
        ends.append(end - 1)
    plan = StepPlan(pool, seqs, chunks, device)
    groups: dict[str, list[int]] = {}  # adapter -> its rows' packed token positions
    start = 0
    for s, c in zip(seqs, chunks, strict=True):
        if s.adapter is not None:
            groups.setdefault(s.adapter, []).extend(range(start, start + len(c)))
        start += len(c)
    adapters = lora.mixed(model, {n: torch.tensor(p, device=device) for n, p in groups.items()})
    config = model.config
    alone = config._attn_implementation
    config._attn_implementation = PAGED
    try:
        with adapters if groups else nullcontext():
            out = model(
                input_ids=torch.tensor([ids], dtype=torch.long, device=device),
                position_ids=torch.tensor([positions], dtype=torch.long, device=device),
                past_key_values=plan,
                use_cache=True,
                logits_to_keep=torch.tensor(ends, dtype=torch.long, device=device),
                kvmem_step=plan,
            )
    finally:
        config._attn_implementation = alone
    return out.logits[0].float()


def step(model: torch.nn.Module, pool: PagePool, prefills: list, decodes: list) -> list[Result]:
    """One prefill chunk of each of `prefills` and one decode step of each of `decodes`, one forward; results
    in the order prefills + decodes: a token, None (a chunk before the prompt's last), or a SequenceError
    (the whole step failed: every row gets it, and their positions are as before the step)."""
    seqs = prefills + decodes
    chunks = [s._prefill[: s.next_chunk_tokens()] for s in prefills] + [[s.last_token] for s in decodes]
    saved = [(s.table.length, s.position) for s in seqs]
    try:
        with torch.inference_mode():
            logits = forward(model, pool, seqs, chunks)
            yields = [i for i, s in enumerate(seqs) if s.decoding or len(chunks[i]) == len(s._prefill)]
            tokens = sampler.sample(logits[yields], [seqs[i] for i in yields]) if yields else []
    except Exception as exc:  # noqa: BLE001 - isolated: alone, each row fails or goes on by itself
        for s, (length, position) in zip(seqs, saved, strict=True):
            s.table.length, s.position = length, position
        if len(seqs) > 1:
            log.warning("an engine step of %d rows failed; running them alone", len(seqs), exc_info=True)
            return [
                (step(model, pool, [s], []) if s in prefills else step(model, pool, [], [s]))[0] for s in seqs
            ]
        seqs[0]._finish("error")
        return [SequenceError(seqs[0], exc)]
    picked = dict(zip(yields, tokens, strict=True))
    results = []
    for i, (s, chunk) in enumerate(zip(seqs, chunks, strict=True)):
        if s.prefilling:
            s._prefill = s._prefill[len(chunk) :]
        s.position += len(chunk)
        token = picked.get(i)
        if token is not None:
            s._accept(token)
        results.append(token)
    return results

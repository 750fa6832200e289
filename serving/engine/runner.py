"""One forward per step for every row: decode rows and prefill chunks, with one attention call per layer.

The step's tokens are packed into input_ids [1, T] (each sequence's chunk, or its last token), each with its
own position. The linear layers see T rows. In every layer, the attention function registered below:
1. writes the step's new K/V into the pool at each token's slot (its sequence's pages);
2. reads the K/V of each group of rows that share an item's pages once for all the group's queries, and
   each row's own rest by its page table into [B, Kmax] (pad slots masked out), its queries into [B, Qmax];
   one batched attention over the rests, with the boolean mask each row would have alone (query i of a
   chunk after P positions sees keys 0 .. P + i), one per prefix group, merged by log-sum-exp; GQA by
   grouping the query heads of each K/V head (no copy of K/V per query head);
3. scatters the outputs back to the packed order.
No Python loop over sequences runs inside a layer: the indices and the mask are built once per step. The
logits are computed only at each row's last position, and every row's token comes out of one host sync
(sampler.py). A chunk that is not its prompt's last yields no token, as alone.

Measured (`benchmarks/engine_bench.py`, /tmp-free: the figures are in its JSON): one SDPA call over every
row's gathered K/V copies a shared block once per row per layer: 8 rows over a 1.9k-token block took 640 ms a
decode step against 277 ms for per-request caches. Reading the shared pages once per group removes that copy.
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
    """The step's indices, built once: where each token's K/V go, what each row reads, and the masks. It is
    passed as `past_key_values` (its `update` leaves K/V to the attention function).

    Rows whose tables begin with the same shared pages (an item's) form a prefix group: the group's queries
    attend to those pages once per layer (a view of the pool when the pages are consecutive, else one
    gather); each row's rest (from the end of its prefix: its copy-on-write page, its own tokens) is gathered
    per row. The two parts are merged exactly by their log-sum-exp (softmax over the union of the keys)."""

    def __init__(self, pool: PagePool, seqs: list, chunks: list[list[int]], device: torch.device) -> None:
        super().__init__(layers=[])
        self.pool = pool
        pt = pool.page_tokens
        lengths = [len(c) for c in chunks]
        pasts = [s.position for s in seqs]
        b, qmax = len(seqs), max(lengths)
        groups: dict[tuple[str, int], list[int]] = {}
        for r, s in enumerate(seqs):
            if s.table.shared_pages and s.table._item_id is not None:
                groups.setdefault((s.table._item_id, s.table.shared_pages), []).append(r)
        starts = [0] * b  # each row's first position after its prefix
        self.prefixes: list[tuple[torch.Tensor, slice | torch.Tensor]] = []
        for (_, shared), rows in groups.items():
            pages = seqs[rows[0]].table.pages[:shared]
            if pages == list(range(pages[0], pages[0] + shared)):
                slots: slice | torch.Tensor = slice(pages[0] * pt, (pages[0] + shared) * pt)
            else:
                slots = pool.slots(pages, 0, shared * pt, device)
            self.prefixes.append((torch.tensor(rows, device=device), slots))
            for r in rows:
                starts[r] = shared * pt
        kmax = max(p + n - st for p, n, st in zip(pasts, lengths, starts, strict=True))
        write, gather, q_index, out_index = [], [], [], []
        start = 0
        for r, (s, n, p) in enumerate(zip(seqs, lengths, pasts, strict=True)):
            write.append(s.table.extend(n, torch.device("cpu")))
            row = pool.slots(s.table.pages, starts[r], p + n)
            gather.append(F.pad(row, (0, kmax - len(row))))
            q_index.append(F.pad(torch.arange(start, start + n), (0, qmax - n)))
            out_index.append(torch.arange(n) + r * qmax)
            start += n
        self.write = torch.cat(write).to(device)
        self.gather = torch.cat(gather).to(device)  # [B * Kmax] slots of each row's rest, row by row
        self.q_index = torch.cat(q_index).to(device)  # [B * Qmax] packed positions, row by row
        self.out_index = torch.cat(out_index).to(device)  # [T] into [B * Qmax]
        q = torch.arange(qmax)[None, :, None]
        k = torch.arange(kmax)[None, None, :] + torch.tensor(starts)[:, None, None]  # absolute positions
        p = torch.tensor(pasts)[:, None, None]
        n = torch.tensor(lengths)[:, None, None]
        mask = (k <= p + q) & (k < p + n)
        mask[:, :, 0] |= q[:, :, 0] >= n[:, :, 0]  # pad query rows see their first key (discarded; no NaN)
        self.mask = None if bool(mask.all()) else mask[:, None, None].to(device)  # [B, 1, 1, Qmax, Kmax]
        self.shape = (b, qmax, kmax)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return key_states, value_states  # written by the attention function

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions are passed explicitly

    @property
    def is_sliding(self) -> list[bool]:
        return [False]


def _attend(q, k, v, mask, scale: float):
    """Softmax attention with its log-sum-exp. q [B, kv, G, Q, d] (G query heads per K/V head), k/v
    [B, kv, K, d], mask None or bool broadcastable to [B, kv, G, Q, K]. Returns out [B, kv, G, Q, d] and
    lse [B, kv, G, Q, 1] (float32)."""
    bsz, kv, g, nq, d = q.shape
    scores = (q.reshape(bsz, kv, g * nq, d) @ k.transpose(-1, -2)).view(bsz, kv, g, nq, -1).float() * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    probs = torch.exp(scores - lse).to(v.dtype).view(bsz, kv, g * nq, -1)
    return (probs @ v).view(bsz, kv, g, nq, d), lse


def _paged_attention(module, query, key, value, attention_mask, *, kvmem_step: StepPlan, scaling=None, **kw):
    st, layer = kvmem_step, module.layer_idx
    k_pool, v_pool = st.pool.k[layer], st.pool.v[layer]  # [slots, kv_heads, dim]
    k_pool.index_copy_(0, st.write, key[0].transpose(0, 1).to(k_pool.dtype))
    v_pool.index_copy_(0, st.write, value[0].transpose(0, 1).to(v_pool.dtype))
    b, qmax, kmax = st.shape
    kv_heads, heads, dim = k_pool.shape[1], query.shape[1], query.shape[3]
    scale = scaling if scaling is not None else dim**-0.5
    g = heads // kv_heads
    q = query[0].index_select(1, st.q_index).view(kv_heads, g, b, qmax, dim).permute(2, 0, 1, 3, 4)
    k = k_pool.index_select(0, st.gather).view(b, kmax, kv_heads, dim).transpose(1, 2)  # [B, kv, K, d]
    v = v_pool.index_select(0, st.gather).view(b, kmax, kv_heads, dim).transpose(1, 2)
    out, lse = _attend(q, k, v, st.mask, scale)
    for rows, slots in st.prefixes:  # each prefix group's shared pages, read once for all its queries
        kp = k_pool[slots] if isinstance(slots, slice) else k_pool.index_select(0, slots)
        vp = v_pool[slots] if isinstance(slots, slice) else v_pool.index_select(0, slots)
        qg = q.index_select(0, rows)  # [R, kv, G, Q, d]
        r = qg.shape[0]
        qg = qg.permute(1, 2, 0, 3, 4).reshape(1, kv_heads, g, r * qmax, dim)
        o_p, l_p = _attend(qg, kp.permute(1, 0, 2)[None], vp.permute(1, 0, 2)[None], None, scale)
        o_p = o_p.view(kv_heads, g, r, qmax, dim).permute(2, 0, 1, 3, 4)
        l_p = l_p.view(kv_heads, g, r, qmax, 1).permute(2, 0, 1, 3, 4)
        o_r, l_r = out.index_select(0, rows), lse.index_select(0, rows)
        m = torch.maximum(l_r, l_p)
        w_r, w_p = torch.exp(l_r - m), torch.exp(l_p - m)
        merged = (o_r.float() * w_r + o_p.float() * w_p) / (w_r + w_p)
        out = out.index_copy(0, rows, merged.to(out.dtype))
    # [B, kv, G, Q, d] -> [B * Q, heads, d] -> the packed order
    out = out.permute(0, 3, 1, 2, 4).reshape(b * qmax, heads, dim).index_select(0, st.out_index)
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

"""The attention of one engine step (runner.py): the kernels a StepPlan's `attend` runs in every layer.

- `wide`: prefill chunks, each row's whole context gathered and padded to the longest, in one
  `scaled_dot_product_attention` (on CUDA a step's one chunk takes the causal mask aligned to its last key, no
  mask tensor: `CAUSAL_DEVICES`);
- `wide_grouped` (CPU): prefill chunks by shared prefix, each group's shared pages read once for all its
  rows' queries, each row's rest gathered, the two merged by log-sum-exp;
- `narrow`: one-token rows, the same way by prefix group, with a sliding window's masks when a layer has one.
Queries are laid out as G query heads per K/V head, so no K/V is expanded per query head.

A layer with logit soft-capping (Gemma 2) or attention sinks (gpt-oss) is attended with the softmax written
out (`attend`'s `softcap`; `sink`): the fused kernels have neither. Its prefill chunks then run `wide` over
each row's gathered context, not by prefix group.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

log = logging.getLogger(__name__)

# PyTorch's fused CPU attention that also returns the log-sum-exp (what the merge of a prefix group needs):
# 2-5x faster than the softmax written out below on the 2-core CPU (8 queries over 600 keys: 188 vs 942 us).
CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
# devices where a step's one prefill chunk is attended as causal attention aligned to the last key
# (`causal_lower_right`) with K/V shared by G query heads (`enable_gqa`), no mask tensor: CUDA's flash kernel
# takes it; an additive mask keeps SDPA off flash (the engine's full prefill of 6,250 tokens took 294 ms on an
# H200 against transformers' 204 ms, issue 43). The CPU keeps its form (its fused kernel is no faster there).
# Only where flash can run (16-bit, head dim <= 256): otherwise torch falls back to the math kernel over a
# materialised mask and [heads, Q, K] scores, where the additive mask keeps the memory-efficient kernel.
CAUSAL_DEVICES = frozenset({"cuda"})
CAUSAL_DTYPES = frozenset({torch.float16, torch.bfloat16})
# The flash kernel over packed sequences of different lengths (cumulative offsets, causal aligned to each
# sequence's last key): what a static prefill chunk (prefill_graphs.py) attends with on CUDA, no mask tensor.
# Against the additive mask it replaced, on an H200 over MemOS's nine cells: 205.5 ms summed against 208.6,
# first tokens equal in 9 of 9 (benchmarks/results/gpu/h200/prefill_graphs_qwen3_8b_99542a4.json): neutral in
# time, and no [Q, K] mask a step. Its signature has held since torch 2.4; `varlen_ready` checks it on the
# device before use.
FLASH_VARLEN = getattr(torch.ops.aten, "_flash_attention_forward", None)
_VARLEN_READY: dict[tuple[str, torch.dtype, int], bool] = {}


def additive(mask: torch.Tensor, dtype: torch.dtype, g: int = 1) -> torch.Tensor:
    """A bool [B, 1, 1, Q, K] mask as the fused kernel's additive mask of `dtype`: [B, 1, 1, K] for one query,
    else [B, 1, G * Q, K] (the queries of G heads per K/V head, as `attend` lays them out)."""
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    b, _, _, nq, k = mask.shape
    if nq == 1:
        return bias.view(b, 1, 1, k)
    return bias.expand(b, 1, g, nq, k).reshape(b, 1, g * nq, k)


def attend(q, k, v, mask, scale: float, bias: torch.Tensor | None = None, softcap: float | None = None):
    """Softmax attention with its log-sum-exp, for few queries. q [B, kv, G, Q, d] (G query heads per K/V
    head), k/v [B, kv, K, d], mask None or a bool [B, 1, 1, 1 or Q, K] (True: attend; every query sees a
    key); `bias`: the mask already made additive (`additive`, once per step rather than per layer), for the
    fused kernel; `softcap`: scores become softcap * tanh(scores / softcap) before the mask (the softmax
    written out). Returns out [B, kv, G, Q, d] and lse [B, kv, G, Q, 1] (float32)."""
    bsz, kv, g, nq, d = q.shape
    if CPU_FLASH is not None and q.device.type == "cpu" and softcap is None:
        if mask is not None and bias is None:
            bias = additive(mask, q.dtype, g)
        # it reads k and v wrongly when their last dimension is not contiguous (torch 2.13, measured): copy them
        k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (k, v))
        out, lse = CPU_FLASH(q.reshape(bsz, kv, g * nq, d), k, v, 0.0, False, attn_mask=bias, scale=scale)
        lse = lse.view(bsz, kv, g, nq, 1)
        return out.view(bsz, kv, g, nq, d), (lse if lse.dtype == torch.float32 else lse.float())
    scores = (q.reshape(bsz, kv, g * nq, d) @ k.transpose(-1, -2)).view(bsz, kv, g, nq, -1).float() * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    probs = torch.exp(scores - lse).to(v.dtype).view(bsz, kv, g * nq, -1)
    return (probs @ v).view(bsz, kv, g, nq, d), lse


def sink(out, lse, sinks: torch.Tensor) -> torch.Tensor:
    """Attention sinks (gpt-oss): one more logit per query head, in the softmax's denominator and with no
    value, which scales each head's output by exp(lse) / (exp(lse) + exp(sink)). out [B, kv, G, Q, d], lse
    [B, kv, G, Q, 1], sinks [kv * G]."""
    b, kv, g = out.shape[:3]
    return out * torch.sigmoid(lse - sinks.float().view(1, kv, g, 1, 1))


def wide(
    st, query, k_pool, v_pool, scale: float, window: int | None, softcap=None, sinks=None
) -> torch.Tensor:
    """Prefill chunks: [tokens, heads, d] in the order of st.wide's positions."""
    b, qmax, kmax, gather, q_index, tokens, _, _ = st.wide
    kv_heads, heads, dim = k_pool.shape[1], query.shape[1], query.shape[3]
    g = heads // kv_heads
    if isinstance(gather, slice):  # one row over one run of pages: a view of the pool
        k, v = k_pool[gather][None].transpose(1, 2), v_pool[gather][None].transpose(1, 2)
    else:
        k = k_pool.index_select(0, gather).view(b, kmax, kv_heads, dim).transpose(1, 2)  # [B, kv, K, d]
        v = v_pool.index_select(0, gather).view(b, kmax, kv_heads, dim).transpose(1, 2)
    if (
        b == 1
        and window is None
        and softcap is None
        and sinks is None
        and query.device.type in CAUSAL_DEVICES
        and query.dtype in CAUSAL_DTYPES
        and dim <= 256
    ):
        # one chunk of Q tokens after P: query i sees keys 0 .. P + i of K = P + Q, the causal mask aligned to
        # the last key; its queries are the rows' only tokens (tokens = 0 .. Q - 1)
        q = query[0].index_select(1, q_index)[None]  # [1, heads, Q, d]
        mask = causal_lower_right(qmax, kmax)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        return out[0].transpose(0, 1).contiguous()  # [Q, heads, d]; flash lays it out so already (no copy)
    # the G query heads of each K/V head are its queries: [B, kv, G, Q, d], no expanded copy of K/V
    q = query[0].index_select(1, q_index).view(kv_heads, g, b, qmax, dim).permute(2, 0, 1, 3, 4)
    if softcap is not None or sinks is not None:
        out, lse = attend(q, k, v, st.wide_mask(window)[:, :, None], scale, softcap=softcap)
        out = out if sinks is None else sink(out, lse, sinks)
    else:
        bias = st.wide_bias(window, query.dtype, g)
        q = q.reshape(b, kv_heads, g * qmax, dim)
        # [B, kv, G * Q, d] by its shape, not its memory: CUDA's kernels lay it out [B, G * Q, kv, d]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
        out = out.view(b, kv_heads, g, qmax, dim)
    return out.permute(0, 3, 1, 2, 4).reshape(b * qmax, heads, dim).index_select(0, tokens)


def wide_grouped(st, query, k_pool, v_pool, scale: float, window: None) -> torch.Tensor:
    """Prefill chunks by shared prefix (StepPlan._wide_groups): [tokens, heads, d] in the order of st.wide's
    positions."""
    _, qmax, _, _, q_index, tokens, _, _ = st.wide
    b, kmax, gather, _, prefixes = st.wide_groups
    kv_heads, heads, dim = k_pool.shape[1], query.shape[1], query.shape[3]
    g = heads // kv_heads
    q = query[0].index_select(1, q_index).view(kv_heads, g, b, qmax, dim).permute(2, 0, 1, 3, 4)
    k = k_pool.index_select(0, gather).view(b, kmax, kv_heads, dim).transpose(1, 2)  # [B, kv, K, d]
    v = v_pool.index_select(0, gather).view(b, kmax, kv_heads, dim).transpose(1, 2)
    out, lse = attend(q, k, v, None, scale, st.grouped_bias(query.dtype, g))
    # [B, kv, G, Q, *] -> the rows' real queries, [tokens, heads, *]
    out = out.permute(0, 3, 1, 2, 4).reshape(b * qmax, heads, dim).index_select(0, tokens)
    lse = lse.permute(0, 3, 1, 2, 4).reshape(b * qmax, heads, 1).index_select(0, tokens)
    for rows, packed, slots in prefixes:  # each group's shared pages, read once for all its rows' queries
        kp, vp = _read(k_pool, slots), _read(v_pool, slots)
        n = packed.shape[0]
        qg = query[0].index_select(1, packed).view(1, kv_heads, g, n, dim)
        o_p, l_p = attend(qg, kp.permute(1, 0, 2)[None], vp.permute(1, 0, 2)[None], None, scale)
        o_p = o_p[0].permute(2, 0, 1, 3).reshape(n, heads, dim)
        l_p = l_p[0].permute(2, 0, 1, 3).reshape(n, heads, 1)
        merged = merge(out.index_select(0, rows), lse.index_select(0, rows), o_p, l_p)
        out = out.index_copy(0, rows, merged.to(out.dtype))
    return out


def varlen_causal(q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float) -> torch.Tensor:
    """Causal attention over packed sequences: q [Tq, heads, d], k/v [Tk, kv_heads, d] (G query heads per K/V
    head), int32 cu_q/cu_k [N + 1] the sequences' offsets in each; query i of a sequence of Q queries over K
    keys sees its keys 0 .. K - Q + i (a sequence with no keys gives zeros). Returns [Tq, heads, d]."""
    return FLASH_VARLEN(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False, scale=scale)[0]


def varlen_ready(device: torch.device, dtype: torch.dtype, dim: int) -> bool:
    """Whether `varlen_causal` runs on `device` in `dtype` for head dim `dim` and gives what SDPA's causal mask
    aligned to the last key gives (checked once per device, dtype and dim on two packed sequences of 3 queries
    over 5 keys and 2 over 2, four query heads over two K/V heads): CUDA, 16-bit, dim <= 256, an op of this
    signature. Not on the model thread's hot path: the first static chunk calls it, before any capture."""
    key = (str(device), dtype, dim)
    if key not in _VARLEN_READY:
        _VARLEN_READY[key] = _check_varlen(device, dtype, dim)
    return _VARLEN_READY[key]


def _check_varlen(device: torch.device, dtype: torch.dtype, dim: int) -> bool:
    if FLASH_VARLEN is None or device.type != "cuda" or dtype not in CAUSAL_DTYPES or dim > 256 or dim % 8:
        return False
    gen = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(n, h, dim, generator=gen).to(device, dtype) for n, h in ((5, 4), (7, 2), (7, 2)))
    cu_q, cu_k = (torch.tensor(c, dtype=torch.int32, device=device) for c in ([0, 3, 5], [0, 5, 7]))
    try:
        out = varlen_causal(q, k, v, cu_q, cu_k, 3, 5, dim**-0.5)
    except Exception:  # noqa: BLE001 - an op of another signature, or no flash kernel for this card
        log.warning("flash varlen attention unavailable: static prefill keeps its mask", exc_info=True)
        return False
    want = []
    for (q0, q1), (k0, k1) in (((0, 3), (0, 5)), ((3, 5), (5, 7))):
        qs, ks, vs = (t.transpose(0, 1)[None] for t in (q[q0:q1], k[k0:k1], v[k0:k1]))
        mask = causal_lower_right(q1 - q0, k1 - k0)
        want.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True)[0])
    err = (out.float() - torch.cat(want, 1).transpose(0, 1).float()).abs().max().item()
    if err > 2e-2:
        log.warning("flash varlen attention differs from SDPA's by %.3g: static prefill keeps its mask", err)
        return False
    return True


def _read(pool: torch.Tensor, slots: slice | torch.Tensor) -> torch.Tensor:
    """A prefix group's K or V: a view of the pool for a slice, else a gather."""
    return pool[slots] if isinstance(slots, slice) else pool.index_select(0, slots)


def merge(o_a, l_a, o_b, l_b) -> torch.Tensor:
    """Two attentions of the same queries over disjoint keys, merged exactly by their log-sum-exps (float32);
    the union's log-sum-exp is torch.logaddexp(l_a, l_b)."""
    m = torch.maximum(l_a, l_b)
    w_a, w_b = torch.exp(l_a - m), torch.exp(l_b - m)
    return (o_a.float() * w_a + o_b.float() * w_b) / (w_a + w_b)


def narrow(
    st, query, k_pool, v_pool, scale: float, window: int | None, softcap=None, sinks=None
) -> torch.Tensor:
    """One-token rows: [rows, heads, d] in the order of st.narrow's positions."""
    b, kmax, gather, positions, _, _ = st.narrow
    mask, prefixes = st.narrow_for(window)
    kv_heads, heads, dim = k_pool.shape[1], query.shape[-2 if query.dim() == 3 else 1], query.shape[-1]
    g = heads // kv_heads
    if query.dim() == 3:  # [T, heads, d] of a step of narrow rows only, in their order (plan.attend)
        q = query.view(b, kv_heads, g, 1, dim)
    else:
        q = query[0].index_select(1, positions).view(kv_heads, g, b, 1, dim).permute(2, 0, 1, 3, 4)
    # [B, kv, K, d]; one row whose slots are one run reads a view of the pool (plan.StepPlan)
    k = _read(k_pool, gather).view(b, kmax, kv_heads, dim).transpose(1, 2)
    v = _read(v_pool, gather).view(b, kmax, kv_heads, dim).transpose(1, 2)
    bias = None
    if mask is not None and CPU_FLASH is not None and q.device.type == "cpu" and softcap is None:
        bias = st.narrow_bias.get(window)
        if bias is None or bias.dtype != q.dtype:  # once per step, not per layer
            bias = st.narrow_bias[window] = additive(mask, q.dtype)
    out, lse = attend(q, k, v, mask, scale, bias, softcap)
    for rows, slots, within in prefixes:  # each prefix group's shared pages, read once for all its rows
        kp, vp = _read(k_pool, slots), _read(v_pool, slots)
        r = rows.shape[0]
        qg = q.index_select(0, rows).permute(1, 2, 0, 3, 4).reshape(1, kv_heads, g, r, dim)
        o_p, l_p = attend(
            qg, kp.permute(1, 0, 2)[None], vp.permute(1, 0, 2)[None], within, scale, softcap=softcap
        )
        o_p = o_p.view(kv_heads, g, r, 1, dim).permute(2, 0, 1, 3, 4)
        l_p = l_p.view(kv_heads, g, r, 1, 1).permute(2, 0, 1, 3, 4)
        l_r = lse.index_select(0, rows)
        merged = merge(out.index_select(0, rows), l_r, o_p, l_p)
        out = out.index_copy(0, rows, merged.to(out.dtype))
        if sinks is not None:  # the union's log-sum-exp, for the sinks' scale
            lse = lse.index_copy(0, rows, torch.logaddexp(l_r, l_p))
    if sinks is not None:
        out = sink(out, lse, sinks)
    return out.reshape(b, heads, dim)  # [B, kv, G, 1, d]: one query per row, already in [B, heads, d] order

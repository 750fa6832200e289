"""A step's plan: where each row's K/V lives in the pool and what each row attends over, built once per step
and read by every layer (runner.py's attention function calls `StepPlan.attend`).

Owns the step's indices and masks: the slots each new token's K/V goes to, the gathered contexts of wide
(prefill) rows, the narrow (one-token) rows' own rest, and the groups of rows that share an item's pages,
read once per group. Knows nothing of sampling, the model loop or requests.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache

from serving.engine import attention
from serving.engine.pages import PagePool


def _consecutive(pages: list[int]) -> bool:
    return pages == list(range(pages[0], pages[0] + len(pages)))


# A prefix group's shared pages are read once for its rows, in an attention of their own merged with each
# row's rest: worth its extra calls (~30 small ops a layer) only when it spares copying enough K/V. Below this
# many token reads (prefix tokens x rows) the rows gather the prefix with their rest. Measured on the 2-core
# CPU (135M model, 8 decode rows): a 32-token system prompt read as a group of 4 made the step ~15% slower.
GROUP_MIN_READS = 2048


def _prefix_groups(tables, pt: int, eligible: list[bool] | None = None) -> dict[tuple[int, ...], list[int]]:
    """The rows (indices into `tables`) that read their shared pages once per group, by those pages: rows
    with shared pages (and `eligible`), in groups reading at least GROUP_MIN_READS tokens."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, t in enumerate(tables):
        if t.shared_pages and (eligible is None or eligible[i]):
            groups.setdefault(t.prefix_key, []).append(i)
    return {pages: rows for pages, rows in groups.items() if len(pages) * pt * len(rows) >= GROUP_MIN_READS}


def _prefix_slots(pool: PagePool, pages: tuple[int, ...], device) -> slice | torch.Tensor:
    """Where a prefix group reads its shared pages: a view of the pool (a slice) when they are one run, else
    their slots."""
    pt = pool.page_tokens
    if _consecutive(list(pages)):
        return slice(pages[0] * pt, (pages[0] + len(pages)) * pt)
    return pool.slots(list(pages), 0, len(pages) * pt, device)


def _wide_mask(q, k, pw, nw, window: int | None) -> torch.Tensor:
    """[B, Qmax, Kmax]: query i of a chunk after P positions sees keys 0 .. P + i (within `window` of it)."""
    mask = (k <= pw + q) & (k < pw + nw)
    if window is not None:
        mask &= k > pw + q - window
    mask[:, :, 0] |= q[:, :, 0] >= nw[:, :, 0]  # pad query rows see key 0 (discarded; no NaN)
    return mask


class PlanCache(Cache):
    """A step's plan as the model's `past_key_values`: its `attend` (called by the attention function
    registered below) writes and reads the K/V, so `update` passes them through; positions are passed
    explicitly."""

    def __init__(self) -> None:
        super().__init__(layers=[])

    def write_kv(self, layer: int, key, value) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's new K/V into the pool at the plan's `write` slots: [1, kv_heads, T, d] as the attention
        interface passes them, or [T, kv_heads, d] as the engine's own layers do (serving/engine/models); the
        layer's pool tensors [slots, kv_heads, d]."""
        k_pool, v_pool = self.pool.k[layer], self.pool.v[layer]
        for pool, new in ((k_pool, key), (v_pool, value)):
            new = new[0].transpose(0, 1) if new.dim() == 4 else new
            pool.index_copy_(0, self.write, new if new.dtype == pool.dtype else new.to(pool.dtype))
        return k_pool, v_pool

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return key_states, value_states  # written by attend

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    @property
    def is_sliding(self) -> list[bool]:
        return [False]


class StepPlan(PlanCache):
    """The step's indices, built once: where each token's K/V go, what each row reads, and the masks. It is
    passed as `past_key_values` (its `update` leaves K/V to the attention function).

    Two kinds of rows, each attended in one batched computation per layer:
    - wide rows (a prefill chunk of several tokens): each row's whole context gathered by its page table
      into [B, Kmax] (pad slots masked out), one `scaled_dot_product_attention` with the mask the row has
      alone (query i of a chunk after P positions sees keys 0 .. P + i); a single wide row whose pages are
      one run (a build without a parent, a prompt without a block: pages.py allocates runs) reads a view
      of the pool instead of a gathered copy;
    - narrow rows (one token: decode steps, a chunk's last token): rows whose tables begin with the same
      shared pages (an item's, or a live session's) form a prefix group whose queries attend to those pages once (a view of the
      pool when the pages are consecutive, else one gather); each row's rest (its copy-on-write page, its own
      tokens) is gathered per row; the two parts are merged exactly by their log-sum-exp. A shared block is
      read once per step, not once per row."""

    def __init__(self, pool: PagePool, seqs: list, chunks: list[list[int]], device: torch.device) -> None:
        super().__init__()
        self.pool = pool
        pt = pool.page_tokens
        # what a row's gathered context is padded with: the scratch slot (pages.py: zeroed, in no page), never
        # slot 0, the first page's (another request's K/V, or memory no one wrote: a NaN there, masked out,
        # still turned a padded row's output to NaN, as NaN x 0 is NaN)
        pad = pool.scratch_slot
        lengths = [len(c) for c in chunks]
        pasts = [s.position for s in seqs]
        starts_at, start = [], 0
        for n in lengths:
            starts_at.append(start)
            start += n
        write = [s.table.extend(n, torch.device("cpu")) for s, n in zip(seqs, lengths, strict=True)]
        self.write = torch.cat(write).to(device)
        wide = [r for r, n in enumerate(lengths) if n > 1]
        narrow = [r for r, n in enumerate(lengths) if n == 1]
        self.wide = None
        self.wide_groups = None  # the wide rows by shared prefix (CPU; see _wide_groups)
        if wide:
            qmax = max(lengths[r] for r in wide)
            kmax = max(pasts[r] + lengths[r] for r in wide)
            gather, q_index, tokens = [], [], []
            for r in wide:
                n, p = lengths[r], pasts[r]
                gather.append(F.pad(pool.slots(seqs[r].table.pages, 0, p + n), (0, kmax - p - n), value=pad))
                q_index.append(F.pad(torch.arange(starts_at[r], starts_at[r] + n), (0, qmax - n)))
                tokens.append(torch.arange(n) + len(tokens) * qmax)
            q = torch.arange(qmax)[None, :, None]
            k = torch.arange(kmax)[None, None, :]
            pw = torch.tensor([pasts[r] for r in wide])[:, None, None]
            nw = torch.tensor([lengths[r] for r in wide])[:, None, None]
            self._wide_parts = (q, k, pw, nw, device)  # for a sliding window's mask (wide_mask)
            mask = _wide_mask(q, k, pw, nw, None)
            # one row whose context is one run of pages: a view of the pool, no gather
            whole = seqs[wide[0]].table.pages[: pool.pages_for(kmax)] if len(wide) == 1 else None
            if whole is not None and _consecutive(whole):
                rows: slice | torch.Tensor = slice(whole[0] * pt, whole[0] * pt + kmax)
            else:
                rows = torch.cat(gather).to(device)  # [B * Kmax] slots, row by row
            self.wide = (
                len(wide),
                qmax,
                kmax,
                rows,
                torch.cat(q_index).to(device),  # [B * Qmax] packed positions
                torch.cat(tokens).to(device),  # the rows' real queries in [B * Qmax], in packed order
                mask[:, None].to(device),
                torch.cat([torch.arange(starts_at[r], starts_at[r] + lengths[r]) for r in wide]).to(device),
            )
            if attention.CPU_FLASH is not None and device.type == "cpu":
                self.wide_groups = self._wide_groups(seqs, wide, lengths, pasts, starts_at, device)
        self.narrow = None
        self.narrow_bias: dict = {}  # the narrow rows' masks, additive, per window (made by attention.narrow)
        self._windowed: dict = {}  # masks and groups for a sliding window, per window (wide_mask, narrow_for)
        if narrow:
            # an item's or a session's pages, read once for every row that has them
            groups = _prefix_groups([seqs[r].table for r in narrow], pt)
            first = [0] * len(narrow)  # each row's first position after its prefix
            prefixes: list[tuple[torch.Tensor, slice | torch.Tensor, torch.Tensor | None]] = []
            for pages, rows in groups.items():
                prefixes.append((torch.tensor(rows, device=device), _prefix_slots(pool, pages, device), None))
                for i in rows:
                    first[i] = len(pages) * pt
            ends = [pasts[r] + 1 for r in narrow]
            kmax = max(e - f for e, f in zip(ends, first, strict=True))
            gather = [
                F.pad(pool.slots(seqs[r].table.pages, f, e), (0, kmax - e + f), value=pad)
                for r, f, e in zip(narrow, first, ends, strict=True)
            ]
            k = torch.arange(kmax)[None, :]
            valid = k < (torch.tensor(ends) - torch.tensor(first))[:, None]  # [B, Kmax]
            positions = torch.tensor([starts_at[r] for r in narrow])
            self._narrow_parts = (k, ends, first, valid, groups, device)  # for a sliding window (narrow_for)
            rows: slice | torch.Tensor = torch.cat(gather)
            if len(narrow) == 1 and rows.shape[0] > 1 and bool((rows[1:] - rows[:-1] == 1).all()):
                rows = slice(int(rows[0]), int(rows[0]) + kmax)  # one row over one run of slots: a view
            self.narrow = (
                len(narrow),
                kmax,
                rows if isinstance(rows, slice) else rows.to(device),
                positions.to(device),  # each row's token in the packed order
                None if bool(valid.all()) else valid[:, None, None, None].to(device),  # [B, 1, 1, 1, K]
                prefixes,
            )

    def _wide_groups(self, seqs, wide, lengths, pasts, starts_at, device) -> tuple | None:
        """The wide rows as the narrow ones are read, for full attention on CPU: rows whose tables begin with
        the same shared pages (a request's chunk after its block or its session) attend to those pages once
        for the group, and each row to its own rest (gathered, padded to the longest rest, causal), merged by
        log-sum-exp. None when no wide row has shared pages.

        Measured on the 2-core CPU (4 chunks of 19 and 54 tokens, two after a 586-token block, with 4 decode
        rows): padded to the longest context, the chunks' attention was ~4.5x the work it needs, 134 of the
        step's 462 ms."""
        pt = self.pool.page_tokens
        tables = [seqs[r].table for r in wide]
        # a chunk after its shared pages (always, for a prompt)
        groups = _prefix_groups(
            tables, pt, [pasts[r] >= t.shared_pages * pt for r, t in zip(wide, tables, strict=True)]
        )
        if not groups:
            return None
        first = [0] * len(wide)
        for rows in groups.values():
            for i in rows:
                first[i] = tables[i].shared_pages * pt
        qmax = self.wide[1]
        ends = [pasts[r] + lengths[r] for r in wide]
        kmax = max(e - f for e, f in zip(ends, first, strict=True))
        gather = [
            F.pad(self.pool.slots(seqs[r].table.pages, f, e), (0, kmax - e + f), value=self.pool.scratch_slot)
            for r, f, e in zip(wide, first, ends, strict=True)
        ]
        q = torch.arange(qmax)[None, :, None]
        k = torch.arange(kmax)[None, None, :]
        pw = torch.tensor([pasts[r] - f for r, f in zip(wide, first, strict=True)])[:, None, None]
        nw = torch.tensor([lengths[r] for r in wide])[:, None, None]
        offsets = [0]  # each wide row's first token among the wide rows' tokens
        for r in wide:
            offsets.append(offsets[-1] + lengths[r])
        prefixes = []
        for pages, rows in groups.items():
            slots = _prefix_slots(self.pool, pages, device)
            tokens = torch.cat([torch.arange(offsets[i], offsets[i + 1]) for i in rows])
            packed = torch.cat(
                [torch.arange(starts_at[wide[i]], starts_at[wide[i]] + lengths[wide[i]]) for i in rows]
            )
            prefixes.append((tokens.to(device), packed.to(device), slots))
        return (
            len(wide),
            kmax,
            torch.cat(gather).to(device),
            _wide_mask(q, k, pw, nw, None)[:, None, None].to(device),  # [B, 1, 1, Qmax, Kmax]
            prefixes,
        )

    # -- a sliding window (layers that attend to the last `window` positions only) ----------------------------
    def wide_mask(self, window: int | None) -> torch.Tensor:
        """The wide rows' mask, for full attention (None) or a sliding window; made once per step each."""
        if window is None:
            return self.wide[6]
        if ("wide", window) not in self._windowed:
            q, k, pw, nw, device = self._wide_parts
            self._windowed["wide", window] = _wide_mask(q, k, pw, nw, window)[:, None].to(device)
        return self._windowed["wide", window]

    def wide_bias(self, window: int | None, dtype: torch.dtype, g: int) -> torch.Tensor:
        """The wide rows' mask, additive, for queries laid out as G heads per K/V head ([B, 1, G * Q, K]):
        made once per step (per window), not per layer."""
        if ("wide_bias", window) not in self._windowed or self._windowed["wide_bias", window].dtype != dtype:
            self._windowed["wide_bias", window] = attention.additive(
                self.wide_mask(window)[:, :, None], dtype, g
            )
        return self._windowed["wide_bias", window]

    def grouped_bias(self, dtype: torch.dtype, g: int) -> torch.Tensor:
        """The mask of the wide rows' rests when read by prefix group (`_wide_groups`), additive, for queries laid
        out as G heads per K/V head ([B, 1, G * Q, K]): made once per step, not per layer."""
        if ("grouped", dtype) not in self._windowed:
            self._windowed["grouped", dtype] = attention.additive(self.wide_groups[3], dtype, g)
        return self._windowed["grouped", dtype]

    def narrow_for(self, window: int | None) -> tuple:
        """(the narrow rows' mask [B, 1, 1, 1, K] or None, their prefix groups) for full attention (None) or
        a sliding window of `window` positions: a row's keys are those after its position minus the window;
        each group's shared keys get a mask for its rows whose window starts inside them, and a row whose
        window starts after them leaves the group (it attends to its rest alone). Made once per step each."""
        if window is None:
            return self.narrow[4], self.narrow[5]
        if ("narrow", window) not in self._windowed:
            k, ends, first, valid, groups, device = self._narrow_parts
            ends, first = torch.tensor(ends), torch.tensor(first)
            lo = ends - window  # a row's first key in its window: position (end - 1) - window + 1
            inside = valid & (first[:, None] + k >= lo[:, None])
            prefixes = []
            for (_, slots, _), pages in zip(self.narrow[5], groups, strict=True):
                shared = len(pages) * self.pool.page_tokens
                kept = [i for i in groups[pages] if lo[i] < shared]
                if not kept:
                    continue
                starts = lo[kept].clamp(min=0)
                mask = None
                if bool((starts > 0).any()):
                    mask = (torch.arange(shared)[None, :] >= starts[:, None])[None, None, None].to(device)
                prefixes.append((torch.tensor(kept, device=device), slots, mask))
            mask = None if bool(inside.all()) else inside[:, None, None, None].to(device)
            self._windowed["narrow", window] = (mask, prefixes)
        return self._windowed["narrow", window]

    def attend(
        self, layer: int, query, key, value, scale: float, window: int | None, softcap=None, sinks=None
    ) -> torch.Tensor:
        """One layer's attention for every row: the step's new K/V into the pool at their slots, then the wide
        and the narrow rows; [1, T, heads, d] in the packed order. `query` [1, heads, T, d] as the attention
        interface passes it, or [T, heads, d] (the engine's own layers); `key`, `value`: see `write_kv`.
        `softcap`, `sinks`: the layer's logit soft-capping and attention sinks, if it has them (attention.py)."""
        k_pool, v_pool = self.write_kv(layer, key, value)
        extra = {"softcap": softcap, "sinks": sinks}
        if query.dim() == 3 and self.wide is not None:  # [T, heads, d] (the engine's own layers)
            query = query.transpose(0, 1)[None]  # only narrow rows take it as it is (attention.narrow)
        # one kind of rows, already in the packed order: no scatter
        if self.wide is None or self.narrow is None:
            if self.narrow is not None:
                one = attention.narrow(self, query, k_pool, v_pool, scale, window, **extra)
            elif self.wide_groups is not None and window is None and softcap is None and sinks is None:
                one = attention.wide_grouped(self, query, k_pool, v_pool, scale, window)
            else:
                one = attention.wide(self, query, k_pool, v_pool, scale, window, **extra)
            return (one if one.dtype == query.dtype else one.to(query.dtype))[None]
        out = query.new_empty(query.shape[2], query.shape[1], query.shape[3])  # [T, heads, d]
        if self.wide is not None:
            if self.wide_groups is not None and window is None and softcap is None and sinks is None:
                wide = attention.wide_grouped(self, query, k_pool, v_pool, scale, window)
            else:
                wide = attention.wide(self, query, k_pool, v_pool, scale, window, **extra)
            out.index_copy_(0, self.wide[-1], wide.to(out.dtype))
        if self.narrow is not None:
            narrow = attention.narrow(self, query, k_pool, v_pool, scale, window, **extra)
            out.index_copy_(0, self.narrow[3], narrow.to(out.dtype))
        return out.unsqueeze(0)

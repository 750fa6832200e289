"""Decode steps replayed as CUDA graphs, one per bucket of (rows, context), on a CUDA device only.

A decode step of a small model on a GPU is launch-bound: one row of the 135M default model's shape took
43.6 ms eagerly on an H100, 30 layers of small kernels with Python between them. A graph records the step's
kernels once and replays them with one launch: on an H200, 4.4 ms against 29.6 eagerly
(benchmarks/results/gpu/). A graph needs every shape and address fixed, so a step that only decodes (no
prefill chunk, no adapter) runs here over static buffers:

- rows are padded to a bucket (1, 2, 4, 8, 16, 32, 64); a pad row's token writes its K/V to the pool's scratch
  slot (pages.py: one slot past the last page, never allocated) and reads only it;
- each row reads its whole context through one slot table [rows, kcap], kcap a power of two >= 512 and at
  least its longest context; slots past a row's length read the scratch slot under a -inf mask. Rows that
  share a block's pages read them once each (the eager step reads them once per group, runner.py): the
  price of fixed shapes, a gather of the block per row per layer;
- one SDPA per layer over [rows, kv_heads, G, d] queries (the G query heads of each K/V head as its queries),
  so grouped-query attention needs no expanded copy of K/V.

The step's inputs (token ids, positions, write slots, lengths, slot table) are filled on the host into one
int64 buffer and copied to the device in one transfer; the graph computes the mask from the lengths. Logits of
every row (pads too) come out as float32; the sampler reads the real rows (one host sync, as eagerly).

The server captures at load (`warm`) every bucket a step can reach: row counts up to its admission bound,
contexts up to what one row can hold (the model's positions, the pool's tokens), the largest first (warm-up
on a side stream, then capture, sharing one memory pool across buckets); nothing is captured later on the
model thread, where the I/O threads copy to the same device meanwhile: a step of a shape not captured at load
runs eagerly. If a capture fails, a warning is logged and that bucket's steps run eagerly; the other buckets
keep their graphs. (A DecodeGraphs that was not warmed, as in a benchmark, captures a bucket when a step
first needs it.)
Without CUDA (`capture=False`, what the CPU tests run) the same static step runs eagerly: its tokens, and
that it makes no host sync and no data-dependent shape (what a capture forbids), are tested on CPU.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from serving.engine import runner
from serving.engine.plan import PlanCache

log = logging.getLogger(__name__)

# 64: a server with --queue-size 64 (the 8B decode at 64 rows ran eager)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
MIN_CONTEXT = 512
MAX_GATHER_SLOTS = 1 << 17  # rows * kcap of the largest bucket: the per-layer gather stays bounded


def _bucket_rows(n: int) -> int | None:
    return next((b for b in ROW_BUCKETS if b >= n), None)


def _bucket_context(n: int) -> int:
    return max(MIN_CONTEXT, 1 << (n - 1).bit_length())


def reachable_shapes(max_context: int, max_rows: int) -> list[tuple[int, int]]:
    """Every (rows, kcap) bucket a pure decode step can run in when no row has more than `max_context` tokens
    of context and no step more than `max_rows` rows, the largest first (as vLLM captures: smaller graphs
    reuse the shared pool's memory). Steps past them (more rows than the largest bucket, a gather past
    MAX_GATHER_SLOTS) run eagerly."""
    top_rows = _bucket_rows(min(max(max_rows, 1), ROW_BUCKETS[-1]))
    top_kcap = _bucket_context(max(max_context, 1))
    kcaps = [MIN_CONTEXT << i for i in range(top_kcap.bit_length()) if MIN_CONTEXT << i <= top_kcap]
    shapes = [(r, k) for r in ROW_BUCKETS if r <= top_rows for k in kcaps if r * k <= MAX_GATHER_SLOTS]
    return sorted(shapes, key=lambda s: (s[0] * s[1], s[0]), reverse=True)


def supports(model: torch.nn.Module) -> bool:
    """Graphs run models whose layers all attend to every past position (a sliding window: eager steps) with
    a plain softmax (logit soft-capping and attention sinks: eager steps, attention.py), with no step that
    reads a device value on the host, which a capture forbids: not rotary embeddings that rescale with the
    positions seen (transformers' "dynamic" and "longrope" read the largest position), nor mixtures of
    experts (their routing selects tokens by value)."""
    config = model.config.get_text_config()
    if getattr(config, "attn_logit_softcapping", None):
        return False
    if any(isinstance(getattr(m, "sinks", None), torch.Tensor) for m in model.modules()):
        return False
    if any(getattr(m, "rope_type", None) in ("dynamic", "longrope") for m in model.modules()):
        return False
    if any(getattr(config, k, None) for k in ("num_experts", "num_local_experts", "n_routed_experts")):
        return False
    types = getattr(config, "layer_types", None)
    if types is not None:
        return set(types) == {"full_attention"}
    return not getattr(config, "sliding_window", None)  # a window with no layer types applies to every layer


class StaticPlan(PlanCache):
    """The indices of one bucket's step in fixed device buffers; `past_key_values` and `kvmem_step` of its
    forward, as plan.StepPlan is of an eager one."""

    def __init__(self, pool, inputs: torch.Tensor, rows: int, kcap: int) -> None:
        super().__init__()
        self.pool, self.rows, self.kcap = pool, rows, kcap
        self.ids, self.positions, self.write, self.lengths = inputs[: 4 * rows].view(4, rows)
        self.gather = inputs[4 * rows :]
        self._keys = torch.arange(kcap, device=inputs.device)
        self.bias: torch.Tensor | None = None

    def begin(self, dtype: torch.dtype) -> None:
        """The mask of this step, once for every layer: row i sees its first lengths[i] keys."""
        seen = self._keys[None, :] < self.lengths[:, None]
        zero = torch.zeros((), dtype=dtype, device=seen.device)
        self.bias = torch.where(seen, zero, torch.full_like(zero, float("-inf")))[:, None, None, :]

    def attend(
        self, layer: int, query, key, value, scale: float, window: int | None, **extra
    ) -> torch.Tensor:
        assert window is None and not extra, "graphs run full attention with no softcap nor sinks (supports)"
        k_pool, v_pool = self.write_kv(layer, key, value)
        rows, heads, dim = self.rows, query.shape[-2 if query.dim() == 3 else 1], query.shape[-1]
        kv_heads = k_pool.shape[1]
        # [1, heads, T, d] from the attention interface, [T, heads, d] from the engine's own layers
        q = query if query.dim() == 3 else query[0].transpose(0, 1)
        q = q.reshape(rows, kv_heads, heads // kv_heads, dim)
        k = k_pool.index_select(0, self.gather).view(rows, self.kcap, kv_heads, dim).transpose(1, 2)
        v = v_pool.index_select(0, self.gather).view(rows, self.kcap, kv_heads, dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias, scale=scale)
        return out.reshape(1, rows, heads, dim)


class _Bucket:
    """One (rows, kcap) shape: its host and device buffers, its plan, and its graph once captured."""

    def __init__(self, model, pool, rows: int, kcap: int, pinned: bool) -> None:
        self.model, self.rows, self.kcap = model, rows, kcap
        size = 4 * rows + rows * kcap
        self.host = torch.empty(size, dtype=torch.long, pin_memory=pinned)
        self.inputs = torch.empty(size, dtype=torch.long, device=pool.k.device)
        self.plan = StaticPlan(pool, self.inputs, rows, kcap)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        self.dtype = pool.k.dtype
        self.pad()

    def pad(self) -> None:
        """Every row a pad row (what a warm-up and a capture run over: they write the scratch slot only)."""
        scratch = self.plan.pool.scratch_slot
        self.host.fill_(scratch)
        self.host[: 2 * self.rows] = 0  # ids, positions
        self.host[3 * self.rows : 4 * self.rows] = 1  # lengths
        self.inputs.copy_(self.host)

    def fill(self, seqs: list) -> None:
        """The real rows' inputs (each row's table grows by its new token), pads after them; one transfer."""
        rows, kcap, pool = self.rows, self.kcap, self.plan.pool
        ids, positions, write, lengths = self.host[: 4 * rows].view(4, rows)
        gather = self.host[4 * rows :].view(rows, kcap)
        gather.fill_(pool.scratch_slot)
        write.fill_(pool.scratch_slot)
        ids.zero_()
        positions.zero_()
        lengths.fill_(1)
        for i, s in enumerate(seqs):
            n = s.position + 1
            write[i] = s.table.extend(1, torch.device("cpu"))[0]
            gather[i, :n] = pool.slots(s.table.pages, 0, n)
            ids[i], positions[i], lengths[i] = s.last_token, s.position, n
        self.inputs.copy_(self.host, non_blocking=self.host.is_pinned())

    def forward(self) -> torch.Tensor:
        self.plan.begin(self.dtype)
        logits = runner.run_model(
            self.model, self.plan.ids[None], self.plan.positions[None], self.plan, logits_to_keep=0
        )
        return logits[0].float()

    def capture(self, mempool) -> None:
        device = self.inputs.device  # the model's device, which need not be the current one (cuda:1)
        with torch.cuda.device(device):
            side = torch.cuda.Stream(device=device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(2):  # lazy initialisations (cuBLAS workspaces) happen outside the capture
                    self.forward()
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # our own stream around the capture's: if the capture fails, this thread's stream is restored;
            # thread_local: other threads (item loads) may use the device while this thread captures
            with torch.cuda.stream(side):
                with torch.cuda.graph(graph, pool=mempool, stream=side, capture_error_mode="thread_local"):
                    self.logits = self.forward()
        self.graph = graph

    def replay(self) -> None:
        with torch.cuda.device(self.inputs.device):
            self.graph.replay()


class DecodeGraphs:
    """The decode steps of one model over one pool (see the module docstring). `capture`: record CUDA graphs
    (default: when the pool is on a CUDA device); False runs the same static steps eagerly."""

    def __init__(self, model: torch.nn.Module, pool, capture: bool | None = None) -> None:
        self.model, self.pool = model, pool
        self.capture = pool.k.device.type == "cuda" if capture is None else capture
        self.buckets: dict[tuple[int, int], _Bucket] = {}
        self.failed: set[tuple[int, int]] = set()  # buckets whose capture failed: their steps run eagerly
        self.warmed = False  # `warm` ran: a bucket it did not capture is never captured later (eager steps)
        self.steps = 0  # static steps run (replayed or eager)
        self.replays = 0  # of which replayed graphs
        self._mempool = torch.cuda.graph_pool_handle() if self.capture else None

    @property
    def broken(self) -> bool:
        """Some bucket's capture failed (its steps run eagerly; the others' replay)."""
        return bool(self.failed)

    def bucket_for(self, decodes: list) -> tuple[int, int] | None:
        """The (rows, kcap) a pure decode step of `decodes` runs in, or None (eager): more rows than the largest
        bucket, an adapter row, a gather past the bound, a bucket whose capture failed, or one not captured at
        load (`warm`)."""
        rows = _bucket_rows(len(decodes))
        if rows is None or any(getattr(s, "adapter", None) is not None for s in decodes):
            return None
        kcap = _bucket_context(max(s.position + 1 for s in decodes))
        shape = (rows, kcap)
        if rows * kcap > MAX_GATHER_SLOTS or shape in self.failed:
            return None
        if self.warmed and self.capture and shape not in self.buckets:
            return None  # not reachable when it was warmed: not captured on the model thread now
        return shape

    def _bucket(self, shape: tuple[int, int]) -> _Bucket | None:
        """The bucket of `shape`, captured the first time; None if its capture failed (then in `failed`)."""
        bucket = self.buckets.get(shape)
        if bucket is None and shape not in self.failed:
            bucket = _Bucket(self.model, self.pool, *shape, pinned=self.capture and self.pool.k.is_cuda)
            if self.capture:
                try:
                    bucket.capture(self._mempool)
                except Exception:  # noqa: BLE001 - graphs are an optimisation: eager steps still serve
                    log.warning(
                        "capturing the decode graph of %s (rows, context) failed; its steps run eagerly",
                        shape,
                        exc_info=True,
                    )
                    self.failed.add(shape)
                    return None
            self.buckets[shape] = bucket
        return bucket

    def warm(self, max_context: int | None = None, max_rows: int = ROW_BUCKETS[-1]) -> int:
        """Capture now (at load) every bucket a step can reach (`reachable_shapes`): contexts up to `max_context`
        tokens (default: what one row can hold, the model's positions and the pool's tokens, the smaller),
        `max_rows` rows (the most sequences decoding at once), so serving never pauses to capture one. A
        failed capture leaves the others. Returns how many buckets are captured."""
        if max_context is None:
            config = self.model.config.get_text_config()
            positions = int(getattr(config, "max_position_embeddings", 0) or 0) or MAX_GATHER_SLOTS
            max_context = min(positions, self.pool.num_pages * self.pool.page_tokens)
        for shape in reachable_shapes(max_context, max_rows):
            self._bucket(shape)
        self.warmed = True
        return len(self.buckets)

    def logits(self, decodes: list, shape: tuple[int, int]) -> torch.Tensor | None:
        """[len(decodes), vocab] float32: one decode step of every row (tables grow by one token each); None
        if the bucket's capture failed (the caller runs the step eagerly, as every later step of that bucket)."""
        bucket = self._bucket(shape)
        if bucket is None:
            return None
        bucket.fill(decodes)
        self.steps += 1
        if bucket.graph is None:
            return bucket.forward()[: len(decodes)]
        bucket.replay()
        self.replays += 1
        return bucket.logits[: len(decodes)]

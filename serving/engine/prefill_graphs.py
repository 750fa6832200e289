"""Prefill chunks replayed as CUDA graphs, one per bucket of (query tokens, context), on a CUDA device only.

On a GPU a query-only forward over a cache already in place (a KV-injected request's prompt after its block)
costs about 40 ms of host overhead whatever its token count (issue 43: Qwen3-8B's shape on an H200, 39-63 ms
for 169-953 query tokens against a ~3.4 ms floor). A graph records the forward's kernels once and replays them
with one launch. A step that is ONE prefill chunk and nothing else (no decode row, no adapter: what a request
arriving alone runs, and the whole of a KV-injected request's time to first token) runs here over static
buffers:

- its query tokens are padded to a bucket (16, 32, 48, 64, 80, ... 2048: TOKEN_BUCKETS); a pad token (id 0 at
  position 0) writes its K/V to the pool's scratch slot (pages.py), and its logits are never read: the logits
  are taken at the last real token only (an index in the inputs);
- the chunk reads its whole context (its pages up to its last token) through one slot table of kcap slots,
  kcap a power of two >= 512; slots past the chunk's end read the scratch slot;
- on CUDA in 16 bits, one flash call per layer over two packed sequences (attention.varlen_causal): the
  chunk's queries over its context, causal to its last key, and the pads' over the slots after it; no mask;
- otherwise (CPU, float32) one SDPA per layer over [1, kv_heads, G * Q, d] queries (G query heads per K/V
  head) under a mask computed in the graph from the chunk's past and real length, once per step: slots past
  the chunk's end are -inf, and a pad attends over the chunk's real keys (so no row is all -inf).

Decision (issue 43 item 3: piecewise with attention outside the graph, or whole with bucketed context): WHOLE.
The step here is one chunk, so the bucketed context costs one gather of kcap slots per layer (at most 2x the
real context, a power of two), cheap next to the 30-40 replays per layer a piecewise capture would need
(one graph per layer segment, the attention eager between them: 2 x layers launches and host work per
step, which is the cost measured). Piecewise is not built; a batch of several prefill chunks, or one with
decode rows, runs eagerly (runner.step). Measured on an H200 (benchmarks/engine/prefill_graphs_bench.py,
benchmarks/results/gpu/h200/): the graphed query forward of Qwen3-8B's shape over MemOS's nine cells takes
10-44 ms against 17-46 eager, 2.0-5.3x its floor.

Inputs (ids, positions, write slots, [past, length, last], slot table) are filled on the host into one int64
buffer and copied in one transfer. Without CUDA (`capture=False`, what the CPU tests run) the same static
step runs eagerly: that its greedy tokens equal a full prefill's, that it makes no host sync, and that pad
tokens write only the scratch slot, are tested on CPU. A bucket whose capture fails runs eagerly (runner.step's
ordinary forward); the others keep their graphs. Like graphs.DecodeGraphs, `warm` captures at load every
bucket a chunk can reach, and nothing is captured on the model thread after it.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F

from serving.engine import attention, runner
from serving.engine.graphs import MIN_CONTEXT, _bucket_context, supports
from serving.engine.plan import PlanCache

log = logging.getLogger(__name__)

# query tokens a chunk is padded up to: steps of 16 to 64, then four to each doubling (a quarter of its start),
# so padding adds at most a quarter (with powers of two it added up to 1.9x: MemOS's 169-token query ran as 256
# tokens; on Qwen3-8B's shape a chunk of a few hundred tokens is compute-bound, its cost grows with its padding)
TOKEN_BUCKETS = (
    (16, 32, 48) + tuple(b + i * b // 4 for b in (64, 128, 256, 512, 1024) for i in range(4)) + (2048,)
)
MAX_MASK = 1 << 23  # query tokens x context of the largest bucket: its mask stays bounded (16 MiB in bf16)
META = 3  # past, real length, index of the last real token


def bucket_tokens(n: int) -> int | None:
    return next((b for b in TOKEN_BUCKETS if b >= n), None)


def reachable_shapes(max_context: int, max_tokens: int) -> list[tuple[int, int]]:
    """Every (tokens, kcap) bucket a lone prefill chunk of at most `max_tokens` tokens can run in when no
    sequence has more than `max_context` tokens, the largest first (smaller graphs reuse the pool's memory)."""
    top_q = bucket_tokens(min(max(max_tokens, 1), TOKEN_BUCKETS[-1]))
    top_k = _bucket_context(max(max_context, 1))
    kcaps = [MIN_CONTEXT << i for i in range(top_k.bit_length()) if MIN_CONTEXT << i <= top_k]
    shapes = [(q, k) for q in TOKEN_BUCKETS if q <= top_q for k in kcaps if q * k <= MAX_MASK]
    return sorted(shapes, key=lambda s: (s[0] * s[1], s[0]), reverse=True)


class StaticPrefillPlan(PlanCache):
    """The indices of one bucket's chunk in fixed device buffers: `past_key_values` and `kvmem_step` of its
    forward, as plan.StepPlan is of an eager step."""

    def __init__(self, pool, inputs: torch.Tensor, tokens: int, kcap: int, flash: bool = True) -> None:
        super().__init__()
        self.pool, self.tokens, self.kcap, self.flash = pool, tokens, kcap, flash
        self.ids, self.positions, self.write = inputs[: 3 * tokens].view(3, tokens)
        self.meta = inputs[3 * tokens : 3 * tokens + META]
        self.last = self.meta[2:3]  # the logits kept: the last real token's
        self.gather = inputs[3 * tokens + META :]
        self._q = torch.arange(tokens, device=inputs.device)
        self._k = torch.arange(kcap, device=inputs.device)
        self.bias: torch.Tensor | None = None
        # flash over two packed sequences, the chunk's and its pads' (attention.varlen_causal): offsets
        # [0, length, tokens] of the queries, [0, past + length, kcap] of the keys
        self._ends = torch.tensor([[0, 0, tokens], [0, 0, kcap]], dtype=torch.int32, device=inputs.device)
        self._at_one = torch.tensor([0, 1, 0], dtype=torch.int32, device=inputs.device)
        self.offsets: tuple[torch.Tensor, torch.Tensor] | None = None

    def begin(self, dtype: torch.dtype) -> None:
        """Once for every layer, the chunk's attention: on CUDA in 16 bits (attention.varlen_ready) the packed
        offsets, the chunk's queries over its context and the pads' over the slots after it (flash, aligned to
        each one's last key, no mask); otherwise the mask: query i sees keys 0 .. past + i, below past + length
        (a pad query, i >= length, sees every real key: never an all -inf row)."""
        past, length = self.meta[0], self.meta[1]
        self.offsets = self.bias = None
        if self.flash and attention.varlen_ready(self.meta.device, dtype, self.pool.k.shape[-1]):
            cu = self._ends + self._at_one * torch.stack((length, past + length)).to(torch.int32)[:, None]
            self.offsets = (cu[0], cu[1])
            return
        seen = (self._k[None, :] <= past + self._q[:, None]) & (self._k[None, :] < past + length)
        zero = torch.zeros((), dtype=dtype, device=seen.device)
        self.bias = torch.where(seen, zero, torch.full_like(zero, float("-inf")))  # [Q, K]

    def attend(
        self, layer: int, query, key, value, scale: float, window: int | None, **extra
    ) -> torch.Tensor:
        assert window is None and not extra, "graphs run full attention with no softcap nor sinks (supports)"
        k_pool, v_pool = self.write_kv(layer, key, value)
        tokens, kv_heads, dim = self.tokens, k_pool.shape[1], query.shape[-1]
        # [1, heads, T, d] from the attention interface, [T, heads, d] from the engine's own layers
        if self.offsets is not None:  # [T, heads, d] packed: the chunk's then the pads'
            q = query[0].transpose(0, 1) if query.dim() == 4 else query
            k, v = k_pool.index_select(0, self.gather), v_pool.index_select(0, self.gather)  # [kcap, kv, d]
            out = attention.varlen_causal(q, k, v, *self.offsets, tokens, self.kcap, scale)
            return out[None]  # [1, T, heads, d]
        q = query[0] if query.dim() == 4 else query.transpose(0, 1)  # [heads, T, d]
        heads = q.shape[0]
        g = heads // kv_heads
        q = q.reshape(1, kv_heads, g * tokens, dim)
        k = k_pool.index_select(0, self.gather).view(1, self.kcap, kv_heads, dim).transpose(1, 2)
        v = v_pool.index_select(0, self.gather).view(1, self.kcap, kv_heads, dim).transpose(1, 2)
        bias = self.bias.expand(g, tokens, self.kcap).reshape(1, 1, g * tokens, self.kcap)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)  # [1, kv, G * T, d]
        return out.reshape(heads, tokens, dim).transpose(0, 1).contiguous()[None]  # [1, T, heads, d]


class _Bucket:
    """One (tokens, kcap) shape: its host and device buffers, its plan, and its graph once captured."""

    def __init__(self, model, pool, tokens: int, kcap: int, pinned: bool, flash: bool = True) -> None:
        self.model, self.tokens, self.kcap = model, tokens, kcap
        size = 3 * tokens + META + kcap
        self.host = torch.empty(size, dtype=torch.long, pin_memory=pinned)
        self.inputs = torch.empty(size, dtype=torch.long, device=pool.k.device)
        self.plan = StaticPrefillPlan(pool, self.inputs, tokens, kcap, flash)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        self.dtype = pool.k.dtype
        self.pad()

    def pad(self) -> None:
        """Every token a pad token of a chunk of length 1 (what a warm-up and a capture run over: they write
        the scratch slot only)."""
        t, scratch = self.tokens, self.plan.pool.scratch_slot
        self.host.fill_(scratch)
        self.host[: 2 * t] = 0  # ids, positions
        self.host[3 * t : 3 * t + META] = torch.tensor([0, 1, 0])
        self.inputs.copy_(self.host)

    def fill(self, seq, chunk: list[int]) -> None:
        """The chunk's inputs (its table grows by len(chunk)), pads after them; one transfer."""
        t, n, past, pool = self.tokens, len(chunk), seq.position, self.plan.pool
        ids, positions, write = self.host[: 3 * t].view(3, t)
        ids.zero_()
        positions.zero_()
        write.fill_(pool.scratch_slot)
        write[:n] = seq.table.extend(n, torch.device("cpu"))
        ids[:n] = torch.tensor(chunk, dtype=torch.long)
        positions[:n] = torch.arange(past, past + n)
        self.host[3 * t : 3 * t + META] = torch.tensor([past, n, n - 1])
        gather = self.host[3 * t + META :]
        gather.fill_(pool.scratch_slot)
        gather[: past + n] = pool.slots(seq.table.pages, 0, past + n)
        self.inputs.copy_(self.host, non_blocking=self.host.is_pinned())

    def forward(self) -> torch.Tensor:
        self.plan.begin(self.dtype)
        logits = runner.run_model(
            self.model, self.plan.ids[None], self.plan.positions[None], self.plan, self.plan.last
        )
        return logits[0].float()  # [1, vocab]

    def capture(self, mempool) -> None:
        device = self.inputs.device
        with torch.cuda.device(device):
            side = torch.cuda.Stream(device=device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(2):  # lazy initialisations happen outside the capture
                    self.forward()
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(side):
                with torch.cuda.graph(graph, pool=mempool, stream=side, capture_error_mode="thread_local"):
                    self.logits = self.forward()
        self.graph = graph

    def replay(self) -> None:
        with torch.cuda.device(self.inputs.device):
            self.graph.replay()


class PrefillGraphs:
    """The lone prefill chunks of one model over one pool (see the module docstring). `capture`: record CUDA
    graphs (default: when the pool is on a CUDA device); False runs the same static steps eagerly. `flash`:
    False keeps the mask where flash could run (a benchmark's comparison)."""

    def __init__(self, model: torch.nn.Module, pool, capture: bool | None = None, flash: bool = True) -> None:
        self.model, self.pool, self.flash = model, pool, flash
        self.capture = pool.k.device.type == "cuda" if capture is None else capture
        self.buckets: dict[tuple[int, int], _Bucket] = {}
        self.failed: set[tuple[int, int]] = set()
        self.warmed = False
        self.steps = 0  # static chunks run (replayed or eager)
        self.replays = 0  # of which replayed graphs
        self._mempool = torch.cuda.graph_pool_handle() if self.capture else None

    def bucket_for(self, seq, n: int) -> tuple[int, int] | None:
        """The (tokens, kcap) a lone chunk of `n` tokens of `seq` runs in, or None (eager): an adapter row,
        more tokens than the largest bucket, a mask past the bound, a failed bucket, one not warmed."""
        tokens = bucket_tokens(n)
        if tokens is None or getattr(seq, "adapter", None) is not None:
            return None
        shape = (tokens, _bucket_context(seq.position + n))
        if shape[0] * shape[1] > MAX_MASK or shape in self.failed:
            return None
        if self.warmed and self.capture and shape not in self.buckets:
            return None
        return shape

    def _bucket(self, shape: tuple[int, int]) -> _Bucket | None:
        bucket = self.buckets.get(shape)
        if bucket is None and shape not in self.failed:
            pinned = self.capture and self.pool.k.is_cuda
            bucket = _Bucket(self.model, self.pool, *shape, pinned=pinned, flash=self.flash)
            if self.capture:
                try:
                    bucket.capture(self._mempool)
                except Exception:  # noqa: BLE001 - graphs are an optimisation: eager chunks still serve
                    log.warning(
                        "capturing the prefill graph of %s failed; its chunks run eagerly",
                        shape,
                        exc_info=True,
                    )
                    self.failed.add(shape)
                    return None
            self.buckets[shape] = bucket
        return bucket

    def warm(self, max_context: int, max_tokens: int) -> int:
        """Capture now (at load) every bucket a lone chunk can reach; returns how many are captured."""
        for shape in reachable_shapes(max_context, max_tokens):
            self._bucket(shape)
        self.warmed = True
        return len(self.buckets)

    def logits(self, seq, chunk: list[int], shape: tuple[int, int]) -> torch.Tensor | None:
        """[1, vocab] float32 at the chunk's last token (its table grows by len(chunk)); None if the bucket's
        capture failed (the caller runs the chunk eagerly)."""
        bucket = self._bucket(shape)
        if bucket is None:
            return None
        bucket.fill(seq, chunk)
        self.steps += 1
        if bucket.graph is None:
            return bucket.forward()
        bucket.replay()
        self.replays += 1
        return bucket.logits


def for_server(model, pool, config, max_context: int) -> PrefillGraphs | None:
    """The server's lone-chunk path (`kvmem serve --prefill-graphs`), from the backend's `config` (its
    prefill_graphs, cuda_graphs and prefill_chunk_tokens): "auto" on a CUDA device when the decode graphs are on,
    "on" on any device (eager static chunks on CPU), "off" none; None too for a model graphs.supports refuses.
    On a CUDA device every bucket a chunk of at most prefill_chunk_tokens can reach (contexts up to
    `max_context` or the pool's tokens, the smaller) is captured now, at load."""
    cuda, mode = pool.k.device.type == "cuda", config.prefill_graphs
    if mode == "off" or (mode == "auto" and not (cuda and config.cuda_graphs)):
        return None
    if not supports(model):
        log.info("prefill graphs off: the model's attention needs the eager path (graphs.supports)")
        return None
    made = PrefillGraphs(model, pool)
    if cuda:
        began = time.perf_counter()
        with torch.inference_mode():  # no capture after load, on the model thread
            captured = made.warm(
                min(max_context, pool.num_pages * pool.page_tokens), config.prefill_chunk_tokens
            )
        log.info(
            "CUDA graphs of lone prefill chunks captured: %d buckets in %.1f s; failed (eager chunks): %s",
            captured,
            time.perf_counter() - began,
            sorted(made.failed) or "none",
        )
    return made

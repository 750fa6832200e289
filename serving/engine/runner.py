"""One forward per step for every row: decode rows and prefill chunks, with one attention call per layer.

The step's tokens are packed into input_ids [1, T] (each sequence's chunk, or its last token), each with its
own position. The linear layers see T rows. In every layer, the attention function registered below:
1. writes the step's new K/V into the pool at each token's slot (its sequence's pages);
2. attends (attention.py): prefill chunks ("wide" rows) in one `scaled_dot_product_attention` over their
   gathered contexts; one-token rows ("narrow": decode steps), and on CPU prefill chunks too, in one batched
   computation over their own rest, plus one per group of rows that share an item's pages, read once for the
   whole group and merged by log-sum-exp (plan.py's StepPlan); GQA by grouping the query heads of each K/V head;
3. scatters the outputs back to the packed order.
A layer with a sliding window (the model's attention passes `sliding_window`, as Mistral's and Qwen2's do)
gets masks that keep each query's last `window` positions; the pages keep every position (a block item and
a session are reused at any length). No Python loop over sequences runs inside a layer: the indices and the
masks are built once per step (once per window). The
logits are computed only at each row's last position, and every row's token comes out of one host sync
(sampler.py). A chunk that is not its prompt's last yields no token, as alone.

Measured on the 2-core CPU (135M model; `benchmarks/engine/engine_bench.py`): one SDPA over every row's gathered
context copied a shared 1.9k-token block once per row per layer (8 decode rows: 640 ms a step against 277 ms
for per-request caches); softmax written out for prefill chunks made a 2k-token prefill 3x slower than SDPA.
Hence the two kinds of rows.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext

import torch
from transformers.modeling_utils import AttentionInterface

from serving.engine import lora, models, sampler
from serving.engine.pages import PagePool
from serving.engine.plan import StepPlan
from serving.engine.sequence import SequenceError

log = logging.getLogger(__name__)

PAGED = "kvmem_paged"  # the attention implementation a step's forward runs under

Result = int | None | SequenceError


def _paged_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    *,
    kvmem_step,
    scaling=None,
    sliding_window=None,
    **kw,
):
    scale = scaling if scaling is not None else query.shape[3] ** -0.5
    extra = {}  # Gemma 2's logit soft-capping, gpt-oss's attention sinks
    if kw.get("softcap") is not None:
        extra["softcap"] = float(kw["softcap"])
    if kw.get("s_aux") is not None:
        extra["sinks"] = kw["s_aux"]
    # a step's plan: this module's StepPlan, or a decode graph's StaticPlan (graphs.py)
    out = kvmem_step.attend(module.layer_idx, query, key, value, scale, sliding_window or None, **extra)
    return out, None  # [1, T, heads, dim], as the attention interface returns


AttentionInterface.register(PAGED, _paged_attention)


def supports(model: torch.nn.Module) -> bool:
    """The engine runs the model's attention itself: causal self-attention over every past position, or over a
    sliding window of them (per layer, as the model's attention modules pass it), with logit soft-capping or
    attention sinks or neither, in a model that calls its attention through transformers' attention interface
    (its class says so, or it runs SDPA)."""
    config = model.config.get_text_config()
    if not set(getattr(config, "layer_types", None) or ["full_attention"]) <= {
        "full_attention",
        "sliding_attention",
    }:
        return False
    return (
        bool(getattr(model, "_supports_attention_backend", False))
        or model.config._attn_implementation == "sdpa"
    )


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
    with adapters if groups else nullcontext():
        return run_model(
            model,
            torch.tensor([ids], dtype=torch.long, device=device),
            torch.tensor([positions], dtype=torch.long, device=device),
            plan,
            torch.tensor(ends, dtype=torch.long, device=device),
            generic=bool(groups),  # adapter rows: peft's layers, under lora.mixed's hooks
        )[0].float()


def run_model(
    model: torch.nn.Module, ids, positions, plan, logits_to_keep, generic: bool = False
) -> torch.Tensor:
    """The model's forward over packed ids [1, T] at `positions` [1, T], its attention run by `plan` (a
    StepPlan, or a decode graph's StaticPlan); logits [1, kept, vocab] in the model's dtype. The engine's own
    layers (serving/engine/models) when the model was enabled for them and not `generic`, else the HF
    forward with the engine's attention registered."""
    fast = None if generic else models.fast_for(model)
    if fast is not None:
        return fast(ids, positions, plan, logits_to_keep)
    config = model.config
    alone = config._attn_implementation
    config._attn_implementation = PAGED
    try:
        return model(
            input_ids=ids,
            position_ids=positions,
            past_key_values=plan,
            use_cache=True,
            logits_to_keep=logits_to_keep,
            kvmem_step=plan,
        ).logits
    finally:
        config._attn_implementation = alone


def step(model: torch.nn.Module, pool: PagePool, prefills: list, decodes: list) -> list[Result]:
    """One prefill chunk of each of `prefills` and one decode step of each of `decodes`, one forward; results
    in the order prefills + decodes: a token, None (a chunk before the prompt's last), or a SequenceError
    (the whole step failed: every row gets it, and their positions are as before the step)."""
    seqs = prefills + decodes
    if not seqs:
        return []
    chunks = [s._prefill[: s.next_chunk_tokens()] for s in prefills] + [[s.last_token] for s in decodes]
    saved = [(s.table.length, s.position) for s in seqs]
    try:
        with torch.inference_mode():
            logits = None
            if pool.graphs is not None and not prefills and decodes:  # a pure decode step: a CUDA graph
                shape = pool.graphs.bucket_for(decodes)
                logits = None if shape is None else pool.graphs.logits(decodes, shape)
            elif pool.prefill_graphs is not None and len(prefills) == 1 and not decodes:  # a lone chunk
                shape = pool.prefill_graphs.bucket_for(prefills[0], len(chunks[0]))
                logits = None if shape is None else pool.prefill_graphs.logits(prefills[0], chunks[0], shape)
            if logits is None:
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

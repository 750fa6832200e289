"""Lone prefill chunks over static buffers (serving/engine/prefill_graphs.py), what a CUDA graph records and
replays. On CPU the same static chunk runs eagerly, its query tokens padded up to a bucket: greedy tokens with
injected KV equal a full prefill's (float32; the tiny Llama, tiny Qwen3 and Qwen2 on the fast path and the
generic one, the real default model), the chunk makes no host sync, and pad tokens write only the scratch
slot. On a CUDA machine the captured graphs give the same tokens."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from kvmem.kv import Sampling, generate
from serving.engine import attention, prefill_graphs, runner
from serving.engine.prefill_graphs import PrefillGraphs
from tests.conftest import prompts_and_blocks
from tests.serving.engine import test_engine
from tests.serving.engine.test_engine import admitted, equal_to_a_full_prefill, make_pool, run_engine
from tests.serving.engine.test_fast_layers import fast, tiny_qwen  # noqa: F401 - `fast` is a fixture
from tests.serving.engine.test_graphs import HostSyncs, same_bits


@pytest.fixture
def static_prefill(monkeypatch):
    """Every pool equal_to_a_full_prefill makes runs lone chunks through PrefillGraphs (uncaptured on CPU);
    yields the list of them."""
    made: list[PrefillGraphs] = []

    def make(model, mb: float = 16, page_tokens: int = 16):
        pool = make_pool(model, mb, page_tokens)
        pool.prefill_graphs = PrefillGraphs(model, pool, capture=False)
        made.append(pool.prefill_graphs)
        return pool

    monkeypatch.setattr(test_engine, "make_pool", make)
    return made


def test_padded_static_prefill_of_the_tiny_llama_equals_a_full_prefill(
    tiny_handle, tokenizer, static_prefill
):
    equal_to_a_full_prefill(tiny_handle.model, tokenizer, "llama")
    g = static_prefill[0]
    assert g.steps > 0 and g.replays == 0
    # chunks of 32 tokens (bucket 32) and whole prompts (padded: none of these is a bucket's size)
    assert {q for q, _ in g.buckets} >= {32, 64} and all(k >= 512 for _, k in g.buckets)


@pytest.mark.parametrize("kind", ["qwen3", "qwen2"])
@pytest.mark.parametrize("path", ["fast", "generic"])
def test_padded_static_prefill_of_tiny_qwen_equals_a_full_prefill(
    tokenizer,
    kind,
    path,
    fast,  # noqa: F811 - the fixture
    static_prefill,
):
    model = tiny_qwen(kind, len(tokenizer))
    decoder = fast(model) if path == "fast" else None
    equal_to_a_full_prefill(model, tokenizer, kind)
    assert static_prefill[0].steps > 0
    if decoder is not None:
        assert decoder.steps > 0


def reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, dropout, causal, debug, scale):
    """What flash's varlen kernel computes (attention.varlen_causal's call), written with SDPA per sequence:
    causal aligned to each sequence's last key, zeros for a sequence with no keys; checks the packing."""
    assert (dropout, causal, debug) == (0.0, True, False) and cu_q[-1] == q.shape[0] == max_q
    assert cu_k[-1] == k.shape[0] == max_k and cu_q.dtype == cu_k.dtype == torch.int32
    out = torch.zeros_like(q)
    qs_at, ks_at = cu_q.tolist(), cu_k.tolist()
    for i in range(len(qs_at) - 1):
        (q0, q1), (k0, k1) = qs_at[i : i + 2], ks_at[i : i + 2]
        if q1 > q0 and k1 > k0:
            qs, ks, vs = (t.transpose(0, 1)[None] for t in (q[q0:q1], k[k0:k1], v[k0:k1]))
            mask = causal_lower_right(q1 - q0, k1 - k0)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True)
            out[q0:q1] = o[0].transpose(0, 1)
    return (out,)


@pytest.fixture
def varlen_on_cpu(monkeypatch):
    """Static chunks attend through attention.varlen_causal on CPU, over reference_varlen."""
    monkeypatch.setattr(attention, "FLASH_VARLEN", reference_varlen)
    monkeypatch.setattr(attention, "varlen_ready", lambda device, dtype, dim: True)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_a_static_chunk_over_packed_sequences_equals_a_full_prefill(
    tiny_handle,
    tokenizer,
    kind,
    fast,  # noqa: F811 - the fixture
    static_prefill,
    varlen_on_cpu,
):
    """The chunk's queries over its context and the pads' over the slots after it, as two packed sequences
    (what flash runs on CUDA): greedy tokens equal a full prefill's, alone, chunked and batched (the generic
    layers' [1, heads, T, d] queries for the Llama, the fast layers' [T, heads, d] for Qwen3)."""
    model = tiny_handle.model if kind == "llama" else tiny_qwen("qwen3", len(tokenizer))
    decoder = fast(model) if kind == "qwen3" else None
    equal_to_a_full_prefill(model, tokenizer, kind)
    plans = [b.plan for g in static_prefill for b in g.buckets.values()]
    assert static_prefill[0].steps > 0 and plans
    assert all(p.offsets is not None and p.bias is None for p in plans)
    assert decoder is None or decoder.steps > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash attention needs a CUDA device")
def test_on_cuda_in_bfloat16_a_captured_static_chunk_attends_with_flash_as_its_mask_would(
    tiny_handle, tokenizer
):
    """The tiny Llama in bfloat16 on CUDA: flash's varlen kernel is ready (it gives SDPA's causal attention on
    the card), and each prompt's logits from a captured static chunk over it are within bf16 rounding of the
    same chunk's with the additive mask."""
    from dataclasses import replace

    from serving.engine.sequence import admit

    model = tiny_handle.model.to("cuda", torch.bfloat16)
    try:
        handle = replace(tiny_handle, device=torch.device("cuda"))
        shape = test_engine.PoolShape.of_model(model)
        assert attention.varlen_ready(torch.device("cuda"), torch.bfloat16, shape.head_dim)
        prompts = [ids for ids, _ in prompts_and_blocks(handle, tokenizer)]

        def logits(flash: bool) -> list[torch.Tensor]:
            pool = test_engine.PagePool(shape, 16 << 20, device="cuda")
            g = PrefillGraphs(model, pool, flash=flash)
            out = []
            with torch.inference_mode():
                for ids in prompts:
                    *_, seq = admit(pool, model, ids, max_new_tokens=1, sampling=Sampling(max_new_tokens=1))
                    out.append(g.logits(seq, ids, g.bucket_for(seq, len(ids))).float().cpu())
                    seq.release()
            assert g.failed == set() and g.replays == g.steps == len(prompts)
            assert all((b.plan.offsets is not None) == flash for b in g.buckets.values())
            return out

        flash, masked = logits(True), logits(False)
        for a, b in zip(flash, masked, strict=True):
            gap = (a - b).abs().max().item()
            print(f"flash vs mask: max |logit difference| {gap:.4f} of {b.abs().max().item():.2f}")
            assert gap <= 0.05 * max(1.0, b.abs().max().item())
    finally:
        tiny_handle.model.to("cpu", torch.float32)


def test_the_default_model_with_injected_kv_and_padded_prefill_equals_a_full_prefill(
    default_handle, tokenizer
):
    """SmolLM2 in float32: each request (two over blocks of memory KV: the query-only forward) prefilled in one
    padded static chunk, alone: its greedy tokens are a full prefill's."""
    model = default_handle.model
    pool = make_pool(model, mb=64)
    pool.prefill_graphs = g = PrefillGraphs(model, pool, capture=False)
    sp = Sampling(max_new_tokens=6)
    for ids, item in prompts_and_blocks(default_handle, tokenizer):
        seqs, errors = run_engine(model, pool, [(ids, item)], [sp], [0], chunk=None)
        assert errors == [] and seqs[0].stats.token_ids == list(generate(model, ids, sampling=sp))
        seqs[0].release()
    assert g.steps == 4 and pool.used_pages == pool.shared.page_count()


def test_a_static_chunk_makes_no_host_sync_and_pads_write_only_the_scratch_slot(tiny_handle, tokenizer):
    model = tiny_handle.model
    pool = make_pool(model)
    g = PrefillGraphs(model, pool, capture=False)
    ids, item = prompts_and_blocks(tiny_handle, tokenizer)[0]
    seq = admitted(pool, model, ids, item, sampling=Sampling(max_new_tokens=2))
    n = seq.next_chunk_tokens()
    shape = g.bucket_for(seq, n)
    assert shape == (prefill_graphs.bucket_tokens(n), 512) and shape[0] > n  # padded
    with torch.inference_mode():
        g.logits(seq, seq._prefill, shape)
        bucket = g.buckets[shape]
        seq.table.length -= n  # the same chunk again, into the same slots
        bucket.fill(seq, seq._prefill)
        probe = HostSyncs()
        with probe:
            logits = bucket.forward()
        assert probe.ops == [] and logits.shape == (1, model.config.vocab_size)
        real = slice(0, pool.scratch_slot)
        k, v = pool.k[:, real].clone(), pool.v[:, real].clone()
        bucket.pad()
        bucket.forward()
        assert same_bits(pool.k[:, real], k) and same_bits(pool.v[:, real], v)
    seq.release()
    assert pool.used_pages == pool.shared.page_count()


def test_what_static_prefill_leaves_to_the_eager_step(tiny_handle, tokenizer):
    model = tiny_handle.model
    pool = make_pool(model, mb=64)
    g = PrefillGraphs(model, pool, capture=False)
    seq = admitted(pool, model, list(range(5, 40)), sampling=Sampling(max_new_tokens=2))
    assert g.bucket_for(seq, 35) == (48, 512) and g.bucket_for(seq, 16) == (16, 512)
    assert g.bucket_for(seq, 2049) is None  # more tokens than the largest bucket
    seq.position = 6064
    assert g.bucket_for(seq, 953) == (1024, 8192)  # MemOS's largest cell
    seq.position = 9000
    assert g.bucket_for(seq, 1000) is None  # 1024 x 16384: past the mask bound
    seq.position = 0
    seq.adapter = "a"
    assert g.bucket_for(seq, 35) is None  # adapter rows: the eager step (lora.py)
    seq.adapter = None
    seq.release()
    assert prefill_graphs.reachable_shapes(1000, 64) == [
        (64, 1024), (48, 1024), (64, 512), (32, 1024), (48, 512), (32, 512), (16, 1024), (16, 512)
    ]  # fmt: skip
    assert prefill_graphs.TOKEN_BUCKETS[3:9] == (64, 80, 96, 112, 128, 160)  # four steps to each doubling
    g.capture = True  # a warmed pool captures nothing later: unwarmed shapes run eagerly
    g.warmed = True
    seq = admitted(pool, model, list(range(5, 40)), sampling=Sampling(max_new_tokens=2))
    assert g.bucket_for(seq, 35) is None
    seq.release()
    # a step with a decode row, or two chunks, runs runner.forward (counted by neither)
    g.capture, g.warmed = False, False
    pool.prefill_graphs = g
    a = admitted(pool, model, list(range(5, 40)), sampling=Sampling(max_new_tokens=2))
    b = admitted(pool, model, list(range(7, 30)), sampling=Sampling(max_new_tokens=2))
    runner.step(model, pool, [a, b], [])
    assert g.steps == 0
    runner.step(model, pool, [], [a, b])
    assert g.steps == 0
    for s in (a, b):
        s.release()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_captured_prefill_graphs_give_a_full_prefills_tokens(tiny_handle, tokenizer):
    model = tiny_handle.model.to("cuda")
    try:
        from dataclasses import replace

        handle = replace(tiny_handle, device=torch.device("cuda"))
        pool = test_engine.PagePool(test_engine.PoolShape.of_model(model), 16 << 20, device="cuda")
        pool.prefill_graphs = g = PrefillGraphs(model, pool)
        sp = Sampling(max_new_tokens=6)
        for ids, item in prompts_and_blocks(handle, tokenizer):
            seqs, errors = run_engine(model, pool, [(ids, item)], [sp], [0], chunk=None)
            assert errors == [] and seqs[0].stats.token_ids == list(generate(model, ids, sampling=sp))
            seqs[0].release()
        assert g.failed == set() and g.replays == g.steps == 4
    finally:
        tiny_handle.model.to("cpu")

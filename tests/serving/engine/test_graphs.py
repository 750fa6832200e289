"""Decode steps over static buffers (serving/engine/graphs.py), what a CUDA graph records and replays. On CPU
the same static step runs eagerly: each request's greedy tokens equal the eager engine's, the step makes no
host sync and no data-dependent shape (what a capture forbids), pad rows write only the scratch slot, and
pages never leak. On a CUDA machine the captured graphs give the eager engine's tokens too."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvmem.kv import Sampling
from serving.engine import graphs, runner
from serving.engine.graphs import DecodeGraphs
from serving.engine.pages import PagePool, PoolShape
from tests.conftest import prompts_and_blocks
from tests.serving.engine.test_engine import admitted, make_pool, run_engine

# ops that read a device value on the host, or whose output shape depends on values: a capture fails on them
FORBIDDEN = ("_local_scalar_dense", "is_nonzero", "aten.nonzero", "masked_select", "aten.item")


class HostSyncs(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(f in str(func) for f in FORBIDDEN):
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def workload(handle, tokenizer):
    """Eight requests of different lengths: two blocks, none, and later ones; one crosses 512 tokens of context
    while it decodes (its steps change bucket)."""
    base = prompts_and_blocks(handle, tokenizer)
    long = (base[0][0] + base[1][0][1:] + base[2][0][1:])[:500]
    requests = base + [(base[0][0][:-3] + base[0][0][-2:], base[0][1]), (long, None), base[2], base[3]]
    samplings = [Sampling(max_new_tokens=n) for n in (5, 12, 9, 3, 30, 24, 11, 6)]
    return requests, samplings, [0, 0, 1, 3, 4, 4, 9, 12]


def run(model, handle, tokenizer, graphed: bool, device="cpu"):
    pool = PagePool(PoolShape.of_model(model), 16 << 20, device=device)
    pool.graphs = DecodeGraphs(model, pool, capture=device != "cpu") if graphed else None
    requests, samplings, arrive = workload(handle, tokenizer)
    seqs, errors = run_engine(model, pool, requests, samplings, arrive, chunk=128)
    assert errors == []
    tokens = [s.stats.token_ids for s in seqs]
    for s in seqs:
        s.release()
    assert pool.used_pages == pool.shared.page_count()  # no page leaked
    return tokens, pool


def test_static_decode_steps_give_the_eager_engines_tokens(tiny_handle, tokenizer):
    model = tiny_handle.model
    items = [item for _, item in prompts_and_blocks(tiny_handle, tokenizer) if item is not None]
    before = [item.kv.clone() for item in items]
    eager, _ = run(model, tiny_handle, tokenizer, graphed=False)
    static, pool = run(model, tiny_handle, tokenizer, graphed=True)
    assert static == eager
    g = pool.graphs
    assert g.steps > 20 and g.replays == 0  # CPU: the static steps run, nothing is captured
    assert sorted(g.buckets) == [(1, 512), (2, 1024), (4, 512)]  # rows padded to 4; one row crossed 512
    for item, kv in zip(items, before, strict=True):
        assert torch.equal(item.kv, kv)  # the stored items are never written


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def test_a_static_step_makes_no_host_sync_and_pads_write_only_the_scratch_slot(tiny_handle, tokenizer):
    model = tiny_handle.model
    pool = make_pool(model)
    pool.graphs = DecodeGraphs(model, pool, capture=False)
    seqs = [
        admitted(pool, model, ids, item, sampling=Sampling(max_new_tokens=4))
        for ids, item in prompts_and_blocks(tiny_handle, tokenizer)[:3]
    ]
    while any(s.prefilling for s in seqs):
        runner.step(model, pool, [s for s in seqs if s.prefilling], [])
    shape = pool.graphs.bucket_for(seqs)
    assert shape == (4, 512)  # three rows, padded
    with torch.inference_mode():
        pool.graphs.logits(seqs, shape)  # makes the bucket
        bucket = pool.graphs.buckets[shape]
        bucket.fill(seqs)
        probe = HostSyncs()
        with probe:
            logits = bucket.forward()
        assert probe.ops == [] and logits.shape == (4, model.config.vocab_size)
        real = slice(0, pool.scratch_slot)
        k, v = pool.k[:, real].clone(), pool.v[:, real].clone()
        bucket.pad()
        bucket.forward()
        # bit for bit: slots no request wrote hold whatever the pool's memory held, NaN patterns included
        # (NaN != NaN, so torch.equal on the floats failed in one CI run with nothing written there)
        assert same_bits(pool.k[:, real], k) and same_bits(pool.v[:, real], v)
    for s in seqs:
        s.release()
    assert pool.used_pages == pool.shared.page_count()


def test_what_graphs_leave_to_the_eager_step(tiny_handle, tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MixtralConfig, Qwen2Config

    model = tiny_handle.model
    pool = make_pool(model, mb=64)
    g = DecodeGraphs(model, pool, capture=False)
    short = admitted(pool, model, list(range(5, 40)), sampling=Sampling(max_new_tokens=2))
    assert g.bucket_for([short] * 3) == (4, 512)
    assert g.bucket_for([short] * 33) == (64, 512) and g.bucket_for([short] * 65) is None  # past the largest
    short.adapter = "a"
    assert g.bucket_for([short]) is None  # adapter rows run in the eager step (lora.py)
    short.adapter = None
    short.position = 5000
    assert g.bucket_for([short] * 16) == (16, 8192) and g.bucket_for([short] * 17) is None  # gather bound
    short.position = 35
    short.release()
    assert graphs.supports(model)
    assert g.warm(2048) == 21 and sorted(g.buckets) == [
        (r, k) for r in (1, 2, 4, 8, 16, 32, 64) for k in (512, 1024, 2048)
    ]
    assert g.warm(8192) == 21 + 6 + 5  # 4096 up to 32 rows, 8192 up to 16 (the gather bound)

    def of(config):
        return SimpleNamespace(config=config, modules=lambda: [])

    assert not graphs.supports(of(MistralConfig(sliding_window=40)))
    assert not graphs.supports(
        of(Qwen2Config(use_sliding_window=True, sliding_window=40, max_window_layers=0))
    )
    assert graphs.supports(of(Qwen2Config()))
    assert not graphs.supports(of(MixtralConfig()))  # routing by value
    config = model.config.to_dict() | {
        "rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}
    }
    dynamic = LlamaForCausalLM(LlamaConfig(**config))  # its rotary embedding reads the largest position
    assert not graphs.supports(dynamic)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_captured_graphs_give_the_eager_engines_tokens(tiny_handle, tokenizer):
    model = tiny_handle.model.to("cuda")
    handle = replace(tiny_handle, device=torch.device("cuda"))  # its items are built on the GPU too
    try:
        eager, _ = run(model, handle, tokenizer, graphed=False, device="cuda")
        static, pool = run(model, handle, tokenizer, graphed=True, device="cuda")
        assert pool.graphs.failed == set() and pool.graphs.replays == pool.graphs.steps > 20
        assert static == eager
    finally:
        tiny_handle.model.to("cpu")


def test_the_server_steps_through_its_pools_graphs(tmp_path, tiny_model_dir):
    """Production wiring: the backend's own pool and step. On CPU the backend makes no graphs (CUDA only): with
    the static steps set on its pool, the same chats (a block, none, a live session's second turn) give the
    same replies as eager steps, through them, and leave only the block's and the session's pages. On CUDA
    (float32, so that eager and graphed steps round alike) the graphs it captured at load do the same."""
    from tests.serving.kvstack import load_backend, served

    cuda = torch.cuda.is_available()
    with served(tmp_path, load_backend(tiny_model_dir, tmp_path, dtype="float32")) as s:
        pool = s.backend.pool
        captured = pool.graphs
        assert (captured is not None) == cuda and s.backend.handle.device.type == ("cuda" if cuda else "cpu")
        pool.graphs = None
        s.add("alice", "I live in Lisbon and keep bees.")
        s.plan("alice")
        s.client.post("/v1/memories/plan/prewarm", params={"user_id": "alice"})
        s.plans.flush()

        def replies(session: str) -> list[str]:
            out = [
                s.chat(user, "Where do I live, and what do I keep?")["choices"][0]["message"]["content"]
                for user in ("alice", "bob")
            ]
            body = {
                "model": "default",
                "user": "alice",
                "max_tokens": 6,
                "temperature": 0,
                "messages": [{"role": "user", "content": "And my bees?"}],
            }
            for _ in range(2):
                r = s.client.post("/v1/chat/completions", json=body, headers={"X-Session-Id": session})
                assert r.status_code == 200, r.text
                out.append(r.json()["choices"][0]["message"]["content"])
            return out

        eager = replies("s1")
        pool.graphs = captured or DecodeGraphs(s.backend.handle.model, pool, capture=False)
        assert replies("s2") == eager
        assert pool.graphs.steps > 0 and pool.graphs.replays == (pool.graphs.steps if cuda else 0)
        assert pool.graphs.failed == set()
        own = {p for e in s.backend.sessions.keys() for p in s.backend.sessions.peek(*e).cache.pages}
        own -= {p for e in pool.shared._entries.values() for p in e.pages}
        own |= set(pool.prefix.pages())  # and the finished replies' full pages the prefix cache keeps
        assert pool.used_pages == pool.shared.page_count() + len(own)


def faked_captures(monkeypatch, failing: tuple[int, int]) -> list:
    """_Bucket.capture replaced (no CUDA here): the bucket `failing` raises, as a failed capture does; the others
    are recorded and left uncaptured (their static steps run eagerly). Returns the record, in order."""
    captured: list = []

    def capture(bucket, _mempool):
        if (bucket.rows, bucket.kcap) == failing:
            raise RuntimeError("operation not permitted when stream is capturing")
        captured.append((bucket.rows, bucket.kcap))

    monkeypatch.setattr(graphs._Bucket, "capture", capture)
    return captured


def capturing(model, pool) -> DecodeGraphs:
    g = DecodeGraphs(model, pool, capture=False)
    g.capture = True  # every new bucket goes through _Bucket.capture (faked)
    return g


def test_a_failed_capture_turns_off_graphs_for_its_bucket_only(tiny_handle, tokenizer, monkeypatch):
    """The workload's steps fall in three buckets; the capture of (4, 512) fails: its steps run eagerly, the
    two others' still run as static steps, and every request gets the eager engine's tokens (before: one
    failure turned graphs off for every bucket, for the life of the process)."""
    model = tiny_handle.model
    eager, _ = run(model, tiny_handle, tokenizer, graphed=False)
    captured = faked_captures(monkeypatch, failing=(4, 512))
    pool = PagePool(PoolShape.of_model(model), 16 << 20)
    pool.graphs = g = capturing(model, pool)
    requests, samplings, arrive = workload(tiny_handle, tokenizer)
    seqs, errors = run_engine(model, pool, requests, samplings, arrive, chunk=128)
    assert errors == [] and [s.stats.token_ids for s in seqs] == eager
    assert sorted(g.buckets) == sorted(captured) == [(1, 512), (2, 1024)]  # the two others kept
    assert g.failed == {(4, 512)}
    assert g.steps > 0  # static steps of the two buckets kept
    for s in seqs:
        s.release()
    assert pool.used_pages == pool.shared.page_count()


def test_warm_captures_every_reachable_bucket_and_nothing_after(tiny_handle, tokenizer, monkeypatch):
    """At load every bucket a step can reach is captured, the largest first; one that fails is left out and
    the rest still captured. After that, a step of a bucket not captured (past the rows or the context it was
    warmed for, or the failed one) runs eagerly: nothing is captured on the model thread (before: the first
    failure stopped the warm-up, and buckets past 2,048 tokens were captured when a step first needed them)."""
    model = tiny_handle.model
    assert graphs.reachable_shapes(2048, 4) == [
        (4, 2048), (4, 1024), (2, 2048), (4, 512), (2, 1024), (1, 2048), (2, 512), (1, 1024), (1, 512)
    ]  # fmt: skip
    assert graphs.reachable_shapes(200_000, 64)[:4] == [
        (64, 2048),
        (32, 4096),
        (16, 8192),
        (8, 16384),
    ]  # the gather bound
    assert len(graphs.reachable_shapes(200_000, 64)) == 42 and graphs.reachable_shapes(1, 1) == [(1, 512)]
    assert len(graphs.reachable_shapes(200_000, 32)) == 39  # a server's rows bound what it captures
    captured = faked_captures(monkeypatch, failing=(2, 1024))
    pool = make_pool(model, mb=64)
    g = capturing(model, pool)
    assert g.warm(2048, max_rows=4) == 8
    assert captured == [s for s in graphs.reachable_shapes(2048, 4) if s != (2, 1024)]
    assert g.failed == {(2, 1024)} and sorted(g.buckets) == sorted(captured)
    row = admitted(pool, model, list(range(5, 40)), sampling=Sampling(max_new_tokens=2))
    assert g.bucket_for([row] * 2) == (2, 512)
    row.position = 700
    assert g.bucket_for([row] * 2) is None  # the failed bucket: eager
    assert g.bucket_for([row] * 3) == (4, 1024)
    assert g.bucket_for([row] * 5) is None  # 8 rows: more than it was warmed for
    row.position = 3000
    assert g.bucket_for([row]) is None  # 4,096 tokens of context: past what it was warmed for
    row.position = 35
    row.release()
    assert len(captured) == 8  # nothing captured after load
    # by default, contexts up to what one row can hold: the model's 8,192 positions, or the pool's tokens
    g = DecodeGraphs(model, make_pool(model, mb=64), capture=False)
    assert g.warm(max_rows=2) == 10 and max(k for _, k in g.buckets) == 8192
    small = make_pool(model, mb=1)  # 128 pages of 16 tokens
    g = DecodeGraphs(model, small, capture=False)
    assert g.warm(max_rows=2) == 6 and max(k for _, k in g.buckets) == 2048

"""The engine (serving/engine): paged KV shared by reference, one forward per step, one attention call per
layer. Alone, a request's greedy tokens equal a full prefill's (decode.generate with no block); batched,
each equals the same request alone; pages are shared (one copy of a block for every request over it), the
stored items are never written, and pages never leak (used pages == resident items' pages after any
workload, failures and cancellations included)."""

from __future__ import annotations

import pytest
import torch

from kvmem.kv import Sampling, generate
from serving.engine import attention, models, runner
from serving.engine import plan as step_plan
from serving.engine.errors import PoolTooSmall
from serving.engine.pages import PagePool, PoolFull, PoolShape
from serving.engine.sequence import AdmissionWait, SequenceError, admit
from tests.conftest import EngineForwards, prompts_and_blocks

CHUNK = 32


def make_pool(model, mb: float = 16, page_tokens: int = 16) -> PagePool:
    """A pool of `mb` MiB on the model's device."""
    device = next(model.parameters()).device
    return PagePool(PoolShape.of_model(model, page_tokens), int(mb * (1 << 20)), device=device)


def admitted(pool, model, ids, item=None, **kw):
    sp = kw.pop("sampling", Sampling())
    seq = None
    for seq in admit(pool, model, ids, item=item, max_new_tokens=sp.max_new_tokens, sampling=sp, **kw):
        assert not isinstance(seq, AdmissionWait), "the pool had room"
    return seq


def run_engine(model, pool, requests, samplings, arrive_at, chunk=CHUNK):
    """Sequence k joins at step arrive_at[k]; each step one runner.step of every prefill chunk and decode."""
    seqs, steps, errors = [], 0, []
    while len(seqs) < len(requests) or any(not s.finished for s in seqs):
        for k, (ids, item) in enumerate(requests):
            if arrive_at[k] == steps:
                seqs.append(
                    admitted(pool, model, ids, item, sampling=samplings[k], prefill_chunk_tokens=chunk)
                )
        prefills = [s for s in seqs if s.prefilling]
        decodes = [s for s in seqs if s.decoding]
        for s, out in zip(prefills + decodes, runner.step(model, pool, prefills, decodes), strict=True):
            if isinstance(out, SequenceError):
                errors.append((s, str(out)))
        steps += 1
    return seqs, errors


@pytest.fixture(params=["every prefix grouped", "production threshold"])
def prefix_groups(request, monkeypatch):
    """Rows read shared pages once per group for every prefix (GROUP_MIN_READS 0), or only past the
    production threshold, which these tiny blocks fall below (each row gathers the prefix with its rest)."""
    if request.param == "every prefix grouped":
        monkeypatch.setattr(step_plan, "GROUP_MIN_READS", 0)
    return request.param


@pytest.fixture(params=["fast", "generic"])
def layers(request, tiny_handle):
    """The tiny llama's steps on the engine's own layers (serving/engine/models: what the server runs for a
    Llama by default) or on the generic path (the HF forward), as `--engine-layers auto|generic`."""
    if request.param == "fast":
        assert models.enable(tiny_handle.model).path == "fast"
    yield request.param
    models.disable(tiny_handle.model)


def test_alone_through_the_engine_equals_a_full_prefill(tiny_handle, tokenizer, prefix_groups, layers):
    """Greedy, with and without a block, in chunks or not: the tokens of decode.generate with no block."""
    model = tiny_handle.model
    pool = make_pool(model)
    for ids, item in prompts_and_blocks(tiny_handle, tokenizer):
        full = list(generate(model, ids, sampling=Sampling(max_new_tokens=12)))
        for chunk in (None, CHUNK):
            seqs, errors = run_engine(model, pool, [(ids, item)], [Sampling(max_new_tokens=12)], [0], chunk)
            assert errors == [] and seqs[0].stats.token_ids == full
            assert seqs[0].stats.reused_tokens == (0 if item is None else min(item.num_tokens, len(ids) - 1))
            seqs[0].release()
    assert pool.used_pages == pool.shared.page_count()


def test_batched_steps_give_each_request_its_tokens_alone(tiny_handle, tokenizer, prefix_groups, layers):
    model = tiny_handle.model
    pool = make_pool(model)
    requests = prompts_and_blocks(tiny_handle, tokenizer)
    requests.append((requests[3][0], None))  # a fifth: seeded sampling, batched too
    samplings = [Sampling(max_new_tokens=n) for n in (5, 12, 9, 3)]
    samplings.append(Sampling(max_new_tokens=6, temperature=0.9, top_p=0.9, seed=5))
    alone = []
    for (ids, item), sp in zip(requests, samplings, strict=True):
        seqs, _ = run_engine(model, pool, [(ids, item)], [sp], [0])
        alone.append(seqs[0].stats.token_ids)
        seqs[0].release()
    items = [item for _, item in requests if item is not None]
    before = [item.kv.clone() for item in items]
    shapes = []
    hook = EngineForwards(lambda ids: shapes.append(tuple(ids.shape)))
    try:
        seqs, errors = run_engine(model, pool, requests, samplings, arrive_at=[0, 1, 1, 2, 2])
    finally:
        hook.remove()
    assert errors == [] and [s.stats.token_ids for s in seqs] == alone
    assert all(torch.equal(item.kv, kv) for item, kv in zip(items, before, strict=True))
    assert max(shapes)[1] > CHUNK  # chunks and decode rows shared forwards
    for s in seqs:
        s.release()
    assert pool.used_pages == pool.shared.page_count()


def test_requests_over_one_block_share_its_pages(tiny_handle, tokenizer, prefix_groups):
    """8 requests of one user over one block: the block's pages once, each request's own tokens apart."""
    model = tiny_handle.model
    pool = make_pool(model)
    ids, item = prompts_and_blocks(tiny_handle, tokenizer)[0]
    sp = Sampling(max_new_tokens=4)
    seqs = [admitted(pool, model, ids, item, sampling=sp) for _ in range(8)]
    pt, reuse = pool.page_tokens, seqs[0].stats.reused_tokens
    block_pages = pool.pages_for(item.num_tokens)
    st = pool.stats()
    assert st["pages_shared"] == block_pages
    # each request's own pages (the partly reused page copied into one, then its prompt's and reply's) are
    # all allocated at admission
    own = pool.pages_for(len(ids) + 4) - reuse // pt
    assert st["pages_used"] == block_pages + 8 * own
    assert [s.table.shared_pages for s in seqs] == [reuse // pt] * 8
    assert all(pool.refs(p) == 1 + 8 for p in seqs[0].table.pages[: reuse // pt])
    while any(not s.finished for s in seqs):
        prefills = [s for s in seqs if s.prefilling]
        decodes = [s for s in seqs if s.decoding]
        runner.step(model, pool, prefills, decodes)
    assert len({tuple(s.stats.token_ids) for s in seqs}) == 1
    assert pool.used_pages == block_pages + 8 * own
    for s in seqs:
        s.release()
        s.release()  # idempotent
    assert pool.used_pages == block_pages == pool.shared.page_count()
    assert pool.shared.drop(item.item_id) and pool.used_pages == 0


def test_a_knowledge_child_references_its_parents_pages(tiny_handle, tokenizer):
    from dataclasses import replace

    from kvmem.kv.item import KVItem
    from kvmem.kv.layout import PromptLayout
    from kvmem.kv.prefill import build_item
    from tests.conftest import synthetic_memories

    model = tiny_handle.model
    layout = PromptLayout(tiny_handle.tokenizer)
    parent_ids = layout.block_ids(synthetic_memories(120, tokenizer, seed=7))
    parent = build_item(tiny_handle, parent_ids, user_id="__knowledge__")
    child_ids = layout.block_ids(synthetic_memories(120, tokenizer, seed=7) + ["I live in Lyon."])
    assert tuple(child_ids[: len(parent_ids) - 1]) == tuple(parent_ids[:-1])
    whole = build_item(tiny_handle, child_ids, user_id="u", prefix=parent)
    k = parent.num_tokens  # as BlockBuilder makes a knowledge child: its own K/V, the parent's by reference
    meta = replace(whole.meta, parent_id=parent.item_id, parent_tokens=k)
    child = KVItem(meta, whole.token_ids, whole.kv[:, :, :, k:].clone(), parent)
    assert child.own_start == k and k % 16 != 0  # the parent's last page is partly the child's
    pool = make_pool(model)
    pages, tokens, entry = pool.shared.acquire(child)
    full = min(child.own_start, parent.num_tokens) // pool.page_tokens
    assert pages[:full] == pool.shared._entries[parent.item_id].pages[:full]
    got = pool.read(pool.slots(pages, 0, tokens))
    assert torch.equal(got, child.kv_range(0, child.num_tokens))
    pool.shared.release(entry)
    assert pool.shared.drop(child.item_id) and pool.shared.drop(parent.item_id) and pool.used_pages == 0


def test_a_full_pool_refuses_admission_and_a_failed_step_leaks_nothing(tiny_handle, tokenizer, layers):
    model = tiny_handle.model
    shape = PoolShape.of_model(model, 16)
    pool = PagePool(shape, 6 * shape.page_bytes)  # 96 tokens
    ids = prompts_and_blocks(tiny_handle, tokenizer)[3][0]
    sp = Sampling(max_new_tokens=len(ids) + 100)
    with pytest.raises(PoolTooSmall) as never:  # at once, however long it may wait (issue 42 item 4)
        next(admit(pool, model, ids, max_new_tokens=sp.max_new_tokens, sampling=sp, wait_s=600))
    total = len(ids) + sp.max_new_tokens
    assert str(never.value) == (
        f"this request needs {total} tokens of KV (its prompt and max_tokens; {-(-total // 16)} pages of 16 "
        "tokens with the block it reads) and the KV pool holds 96 tokens (6 pages): lower max_tokens or "
        "shorten the conversation"
    )
    held = pool.alloc(5)  # another request's: room for 1 page now, the request needs more
    with pytest.raises(PoolFull, match="free pages"):
        list(admit(pool, model, ids, max_new_tokens=4, sampling=Sampling(max_new_tokens=4), wait_s=0))
    pool.release(held)
    assert pool.used_pages == 0 and pool.free_pages == 6
    seq = admitted(pool, model, ids, sampling=Sampling(max_new_tokens=4))
    boom = EngineForwards(lambda ids: (_ for _ in ()).throw(RuntimeError("boom")))
    try:
        out = runner.step(model, pool, [seq], [])
    finally:
        boom.remove()
    assert isinstance(out[0], SequenceError) and seq.finish_reason == "error"
    seq.release()
    assert pool.used_pages == 0 and pool.free_pages == 6


def engine_metrics(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith("kvmem_engine_"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_the_server_reports_its_pages_and_leaks_none(tmp_path, tiny_model_dir):
    """Through the HTTP app and the production backend: requests with a block, without, and two turns of a
    live session; afterwards the pages in use are exactly the resident blocks' pages and the live session's,
    and /metrics says so; deleting the memory drops the block's and the session's pages."""
    from tests.serving.kvstack import load_backend, served

    with served(tmp_path, load_backend(tiny_model_dir, tmp_path)) as s:
        memory = s.add("alice", "I live in Lisbon and keep bees.")
        s.plan("alice")
        s.client.post("/v1/memories/plan/prewarm", params={"user_id": "alice"})
        s.plans.flush()
        for user in ("alice", "bob", "alice"):
            r = s.chat(user)
            assert r["choices"][0]["message"]["content"] is not None
        body = {
            "model": "default",
            "user": "alice",
            "max_tokens": 3,
            "messages": [{"role": "user", "content": "And my bees?"}],
        }
        for _ in range(2):  # a live session: its second turn starts from the pages the first left
            r = s.client.post("/v1/chat/completions", json=body, headers={"X-Session-Id": "s1"})
            assert r.status_code == 200, r.text
        assert s.backend.sessions.stats.hits == 1
        pool = s.backend.pool
        block = s.plan("alice")
        assert block is not None and block["item_id"] in pool.shared
        # the block's pages and the system prompt's head (bob has no block), shared by every request
        head = pool.pages_for(s.backend.head_item.num_tokens)
        assert s.backend.head_item.item_id in pool.shared
        assert pool.shared.page_count() == pool.pages_for(block["tokens"]) + head
        table = s.backend.sessions.peek("alice", "s1").cache
        session_own = set(table.pages) - {p for e in pool.shared._entries.values() for p in e.pages}
        assert len(session_own) * pool.shape.page_bytes == table.nbytes > 0
        # the finished replies' full pages the prefix cache keeps (alice's and bob's), beyond those
        cached = (
            set(pool.prefix.pages())
            - session_own
            - {p for e in pool.shared._entries.values() for p in e.pages}
        )
        assert pool.prefix.pages("bob") and pool.prefix.pages("alice")
        assert pool.used_pages == pool.shared.page_count() + len(session_own) + len(cached)
        m = engine_metrics(s.client.get("/metrics").text)
        assert m["kvmem_engine_kv_pages_used"] == pool.used_pages
        assert m['kvmem_engine_kv_bytes{kind="shared"}'] == pool.shared.page_count() * pool.shape.page_bytes
        # prefix_cache: the pages the prefix cache holds (some a live session reads too); private: the rest
        held = set(pool.prefix.pages())
        assert m['kvmem_engine_kv_bytes{kind="prefix_cache"}'] == len(held) * pool.shape.page_bytes > 0
        assert m['kvmem_engine_kv_bytes{kind="private"}'] == len(session_own - held) * pool.shape.page_bytes
        assert len(held) == len(cached) + len(session_own & held)
        assert s.client.delete(f"/v1/memories/{memory}", params={"user_id": "alice"}).status_code == 200
        # the delete took alice's block, session and cached pages; bob's cached pages stay
        assert pool.prefix.pages("alice") == [] and block["item_id"] not in pool.shared
        assert pool.used_pages == head + len(set(pool.prefix.pages("bob")))
        assert s.backend.sessions.keys() == []


ADAPTER_KINDS = {
    "lora": {"target_modules": "all-linear"},
    "dora": {"target_modules": "all-linear", "use_dora": True},
    "embedding": {"target_modules": ["embed_tokens", "q_proj", "v_proj"]},
}


def tiny_gpt2(vocab_size: int):
    """A tiny GPT-2: its projections are transformers' Conv1D layers (weights transposed), absolute positions."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=vocab_size, n_embd=64, n_layer=2, n_head=4, n_positions=4096, initializer_range=0.2
    )
    return GPT2LMHeadModel(config).eval()


GPT2_ADAPTERS = {"target_modules": ["c_attn", "c_proj", "c_fc"], "fan_in_fan_out": True}
ADAPTER_KINDS["lora on gpt-2's conv1d"] = GPT2_ADAPTERS
ADAPTER_KINDS["dora on gpt-2's conv1d"] = GPT2_ADAPTERS | {"use_dora": True}


def test_an_adapter_on_a_true_convolution_is_one_the_engine_cannot_run():
    """`lora.supports` (what the adapter slots refuse: serving/backends/transformers/adapters.py) is False for a LoRA on a
    torch Conv1d, True for the same model's linear layer alone."""
    peft = pytest.importorskip("peft")
    from serving.engine import lora

    class ConvAndLinear(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.proj = torch.nn.Conv1d(8, 8, 3), torch.nn.Linear(8, 8)

    conv = peft.LoraConfig(r=2, target_modules=["conv", "proj"])
    model = peft.PeftModel(ConvAndLinear(), conv, adapter_name="conv")
    model.add_adapter("linear", peft.LoraConfig(r=2, target_modules=["proj"]))
    assert not lora.supports(model, "conv") and lora.supports(model, "linear")


@pytest.mark.parametrize("kind", sorted(ADAPTER_KINDS))
def test_requests_under_different_adapters_and_none_share_a_step(tiny_handle, tokenizer, kind):
    """Two LoRA adapters and the base model in one forward per step (serving/engine/lora.py): each request's
    greedy tokens equal peft's own output for its adapter alone (adapter layers on, set to it). Plain LoRA,
    DoRA (peft's variant on the adapter's rows), LoRA on the token embeddings, and both on GPT-2's Conv1D
    layers (peft adapts them as linear layers with transposed weights)."""
    import copy

    peft = pytest.importorskip("peft")
    from kvmem.models import handle_for
    from serving.engine import lora

    if "gpt-2" in kind:
        model = tiny_gpt2(len(tokenizer))
        assert runner.supports(model)
        tiny_handle = handle_for(model, tokenizer, model_id="tiny-gpt2")
    else:
        model = copy.deepcopy(tiny_handle.model)
    torch.manual_seed(3)
    config = peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **ADAPTER_KINDS[kind])
    wrapped = peft.PeftModel(model, config, adapter_name="a")
    wrapped.add_adapter("b", config)
    for name, p in wrapped.named_parameters():
        if "lora_B" in name or "lora_embedding_B" in name:
            torch.nn.init.normal_(p, std=0.2)  # both adapters change the outputs
    wrapped.eval()
    lora_layers = wrapped.base_model
    assert lora.supports(model, "a") and lora.supports(model, "b")
    requests = prompts_and_blocks(tiny_handle, tokenizer)
    ids = [requests[k][0] for k in (1, 3, 3)]  # no block: items are the base model's K/V
    adapters = ["a", None, "b"]
    sp = Sampling(max_new_tokens=6)
    alone = []
    for prompt, name in zip(ids, adapters, strict=True):
        if name is None:
            lora_layers.disable_adapter_layers()
        else:
            lora_layers.enable_adapter_layers()
            lora_layers.set_adapter(name)
        alone.append(list(generate(model, prompt, sampling=sp)))
    lora_layers.disable_adapter_layers()
    assert len({tuple(a) for a in alone}) == 3  # the adapters change the answer: the test can fail
    pool = make_pool(model)
    seqs = [
        admitted(pool, model, p, sampling=sp, adapter=n, prefill_chunk_tokens=CHUNK)
        for p, n in zip(ids, adapters, strict=True)
    ]
    forwards = []
    hook = EngineForwards(lambda ids: forwards.append(1))
    try:
        while any(not s.finished for s in seqs):
            runner.step(model, pool, [s for s in seqs if s.prefilling], [s for s in seqs if s.decoding])
    finally:
        hook.remove()
    assert [s.stats.token_ids for s in seqs] == alone
    assert len(forwards) < sum(len(a) for a in alone)  # the three shared forwards
    for s in seqs:
        s.release()
    assert pool.used_pages == 0


def test_a_request_the_pool_can_never_hold_gets_400_at_once(tmp_path, tiny_model_dir):
    """Issue 42 item 4, through the HTTP app: a reply that needs more pages than the whole pool has is refused
    at once with 400 kv_pool_too_small naming its size and the pool's (it waited `kv_wait_s`, evicting every
    resident block on each try, then got a retryable 429); nothing was evicted for it."""
    from tests.serving.kvstack import load_backend, served

    backend = load_backend(tiny_model_dir, tmp_path, kv_pool_mb=1, kv_wait_s=0.0)
    with served(tmp_path, backend) as s:
        pool = backend.pool
        capacity = pool.num_pages * pool.page_tokens
        head_pages = pool.pages_for(backend.head_item.num_tokens)
        s.chat("bob")  # the system prompt's shared head is resident, unread; bob's full pages stay cached
        cached = pool.prefix.pages("bob")
        assert pool.shared.page_count() == head_pages and pool.used_pages == head_pages + len(cached)
        body = {
            "model": "default",
            "user": "bob",
            "max_tokens": capacity + 10,
            "messages": [{"role": "user", "content": "Tell me everything."}],
        }
        r = s.client.post("/v1/chat/completions", json=body)
        error = r.json()["error"]
        assert r.status_code == 400 and (error["code"], error["param"]) == ("kv_pool_too_small", "max_tokens")
        assert error["message"].startswith("this request needs ") and error["message"].endswith(
            f"and the KV pool holds {capacity} tokens ({pool.num_pages} pages): lower max_tokens or shorten "
            "the conversation"
        )
        # nothing evicted for it: the head and bob's cached pages are still there
        assert pool.shared.page_count() == head_pages and pool.prefix.pages("bob") == cached
        assert pool.used_pages == head_pages + len(cached)


def test_a_request_that_finds_the_pool_full_gets_429_with_retry_after(tmp_path, tiny_model_dir):
    """Through the HTTP app: a request that fits the pool but finds its pages held waits `kv_wait_s`, then
    gets 429 kv_pool_full with Retry-After; nothing is left allocated for it, and it is served once the pages
    are back."""
    from tests.serving.kvstack import load_backend, served

    backend = load_backend(tiny_model_dir, tmp_path, kv_pool_mb=1, kv_wait_s=0.0)
    with served(tmp_path, backend) as s:
        pool = backend.pool
        held = pool.alloc(pool.num_pages)  # another's pages, every one (the unread head went for them)
        body = {
            "model": "default",
            "user": "bob",
            "max_tokens": 8,
            "messages": [{"role": "user", "content": "Tell me everything."}],
        }
        r = s.client.post("/v1/chat/completions", json=body)
        assert r.status_code == 429 and r.json()["error"]["code"] == "kv_pool_full"
        assert r.headers["Retry-After"] == "1" and "free pages" in r.json()["error"]["message"]
        assert pool.used_pages == pool.num_pages
        pool.release(held)
        assert s.chat("bob")["choices"][0]["finish_reason"] in ("stop", "length")
        # only the head stays resident (unread now: the first thing evicted when pages are short), with the
        # reply's full pages in bob's prefix cache
        head_pages = pool.pages_for(backend.head_item.num_tokens)
        assert pool.shared.page_count() == head_pages
        assert (
            pool.used_pages
            == head_pages + len(pool.prefix.pages())
            == head_pages + len(pool.prefix.pages("bob"))
        )


@pytest.mark.skipif(attention.CPU_FLASH is None, reason="this torch has no fused CPU attention with its lse")
def test_prefill_rows_read_the_attention_output_by_shape_not_memory(tiny_handle, tokenizer, monkeypatch):
    """CUDA's SDPA kernels return [B, H, L, d] laid out in memory as [B, L, H, d] (CPU's is contiguous): the
    batched prefill chunks give the same tokens with the output so laid out, in one step, with no row failing
    over to running alone (the H200 run of 2026-11-27 found `.view` refusing it there)."""
    model = tiny_handle.model
    pool = make_pool(model)
    requests = prompts_and_blocks(tiny_handle, tokenizer)
    samplings = [Sampling(max_new_tokens=n) for n in (5, 12, 9, 3)]
    plain, errors = run_engine(model, pool, requests, samplings, arrive_at=[0, 0, 0, 0])
    assert errors == []
    sdpa, calls = torch.nn.functional.scaled_dot_product_attention, []

    def cuda_layout(*args, **kwargs):
        out = sdpa(*args, **kwargs)
        calls.append(out.shape[0])
        return out.transpose(1, 2).contiguous().transpose(1, 2)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", cuda_layout)
    failed = []
    monkeypatch.setattr(runner.log, "warning", lambda *a, **k: failed.append(a))
    cuda, errors = run_engine(model, pool, requests, samplings, arrive_at=[0, 0, 0, 0])
    assert errors == [] and failed == [] and max(calls) == len(requests)  # one SDPA over the four chunks
    assert [s.stats.token_ids for s in cuda] == [s.stats.token_ids for s in plain]
    for s in plain + cuda:
        s.release()
    assert pool.used_pages == pool.shared.page_count()
    assert runner.step(model, pool, [], []) == []  # no rows: each request done, the next not yet come


def test_the_fused_cpu_attention_gives_the_written_out_softmax_and_its_log_sum_exp(monkeypatch):
    torch.manual_seed(0)
    q = torch.randn(4, 3, 3, 2, 16)  # [rows, kv heads, query heads per kv head, queries, dim]
    k, v = torch.randn(4, 3, 37, 16), torch.randn(4, 3, 37, 16)
    mask = torch.rand(4, 1, 1, 1, 37) > 0.3
    mask[..., 0] = True
    strided = k.transpose(2, 3).contiguous().transpose(2, 3)  # the kernel misreads it unless copied first
    for m, keys in ((None, k), (mask, k), (None, strided), (mask, strided)):
        fused = attention.attend(q, keys, v, m, 0.25)
        monkeypatch.setattr(attention, "CPU_FLASH", None)
        written = attention.attend(q, k, v, m, 0.25)
        monkeypatch.undo()
        assert fused[0].shape == written[0].shape and fused[1].shape == written[1].shape
        assert fused[1].dtype == torch.float32
        torch.testing.assert_close(fused[0], written[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(fused[1], written[1], rtol=1e-5, atol=1e-5)


def test_a_sequences_own_pages_are_one_run_and_its_prefill_reads_a_view(tiny_handle, tokenizer):
    """Pages are taken as a consecutive run when the free pages hold one, even after others were freed
    out of order; a lone prefill chunk over one run attends to a view of the pool (no gathered slots), and
    gives the tokens of a full prefill."""
    model = tiny_handle.model
    pool = make_pool(model)
    held = [pool.alloc(1) for _ in range(6)]
    pool.release(held[1] + held[3])  # two single free pages below the rest
    ids = prompts_and_blocks(tiny_handle, tokenizer)[1][0]
    seq = admitted(pool, model, ids, sampling=Sampling(max_new_tokens=6), prefill_chunk_tokens=CHUNK)
    pages = seq.table.pages
    assert len(pages) == pool.pages_for(len(ids) + 6) > 2
    assert pages == list(range(pages[0], pages[0] + len(pages)))
    plan = step_plan.StepPlan(pool, [seq], [seq._prefill[:CHUNK]], torch.device("cpu"))
    seq.table.length, seq.position = 0, 0  # the plan above only looked: undo its extend
    assert isinstance(plan.wide[3], slice)
    while not seq.finished:
        runner.step(model, pool, [seq] if seq.prefilling else [], [seq] if seq.decoding else [])
    full = list(generate(model, ids, sampling=Sampling(max_new_tokens=6)))
    assert seq.stats.token_ids == full
    seq.release()
    for p in held[0] + held[2] + held[4] + held[5]:
        pool.release([p])
    assert pool.used_pages == 0


# the tiny models of other attention below: two layers, grouped-query heads, a sliding window of 40
TINY_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    initializer_range=0.2,
    sliding_window=40,
)


def tiny_sliding(kind: str, vocab_size: int):
    """A tiny model whose layers attend to a sliding window of 40 positions: every layer (mistral) or the
    second only (qwen2, `max_window_layers` 1: full then sliding)."""
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    shape = dict(TINY_SHAPE, vocab_size=vocab_size, tie_word_embeddings=True)
    torch.manual_seed(0)
    if kind == "mistral":
        return MistralForCausalLM(MistralConfig(**shape)).eval()
    return Qwen2ForCausalLM(Qwen2Config(**shape, use_sliding_window=True, max_window_layers=1)).eval()


@pytest.mark.parametrize("kind", ["mistral", "qwen2"])
def test_sliding_window_layers_in_the_engine_equal_a_full_prefill(tokenizer, kind, monkeypatch):
    """Models with sliding-window layers run in the engine: alone (with a block's pages or none, in chunks) and
    batched (rows of one block share its pages), each request's greedy tokens equal the model's own full
    prefill, whose mask keeps only the window; the window is shorter than every prompt and block. Rows of a
    block whose window starts inside its shared pages attend to them masked, and rows whose window starts
    after them leave the group: both happen."""

    model = tiny_sliding(kind, len(tokenizer))
    assert runner.supports(model)
    groups = {"masked": 0, "left": 0}
    narrow_for = step_plan.StepPlan.narrow_for

    def counted(plan, window):
        mask, prefixes = narrow_for(plan, window)
        if window is not None:
            groups["masked"] += sum(1 for *_, within in prefixes if within is not None)
            groups["left"] += len(plan.narrow[5]) - len(prefixes)
        return mask, prefixes

    monkeypatch.setattr(step_plan.StepPlan, "narrow_for", counted)
    monkeypatch.setattr(step_plan, "GROUP_MIN_READS", 0)  # every shared prefix read as a group
    config = model.config.get_text_config()
    assert config.sliding_window == 40
    if kind == "qwen2":
        assert config.layer_types == ["full_attention", "sliding_attention"]
    # replies long enough that a row's window moves past its block's shared pages as it decodes
    pool, _, _ = equal_to_a_full_prefill(model, tokenizer, kind, min_prompt=41, max_new=48)
    assert pool.used_pages == pool.shared.page_count()
    assert groups["masked"] > 0 and groups["left"] > 0


def equal_to_a_full_prefill(model, tokenizer, kind: str, min_prompt: int = 0, max_new: int = 8):
    """The four requests of prompts_and_blocks and a fifth over the first one's block (a prefix group with
    it), alone (in chunks or not) and batched: each one's greedy tokens are the model's own full prefill's.
    Returns (the pool, a batch runner, the full prefills' tokens of the batch)."""
    from kvmem.models import handle_for

    handle = handle_for(model, tokenizer, model_id=f"tiny-{kind}")
    requests = prompts_and_blocks(handle, tokenizer)
    assert min(len(ids) for ids, _ in requests) >= min_prompt
    sp = Sampling(max_new_tokens=max_new)
    full = [list(generate(model, ids, sampling=sp)) for ids, _ in requests]
    pool = make_pool(model)
    for (ids, item), expected in zip(requests, full, strict=True):
        for chunk in (None, CHUNK):
            seqs, errors = run_engine(model, pool, [(ids, item)], [sp], [0], chunk)
            assert errors == [] and seqs[0].stats.token_ids == expected
            seqs[0].release()
    batch = requests + [requests[0]]  # two rows over one block: a prefix group

    def batched() -> list[list[int]]:
        seqs, errors = run_engine(model, pool, batch, [sp] * len(batch), [0, 1, 2, 3, 5])
        assert errors == []
        for s in seqs:
            s.release()
        return [s.stats.token_ids for s in seqs]

    assert batched() == full + full[:1]
    return pool, batched, full + full[:1]


def tiny_capped(kind: str, vocab_size: int):
    """A tiny Gemma 2 (attention logits soft-capped at 1.0, scaled by 1/2 so that the cap changes them) or
    gpt-oss (attention sinks drawn near its logits' log-sum-exps, so that they change the outputs; mixture of
    experts): layers alternate a sliding window of 40 and full attention. Both run transformers' written-out
    ("eager") attention, which applies the cap and the sinks (its SDPA path would ignore the cap): the
    reference the engine must equal. Leaving out the cap or the sinks in any one of the engine's paths (prefill
    chunks, a decode row's rest, its prefix group, the group's log-sum-exp) changes greedy tokens (checked by
    hand, 2026-11-27)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM, GptOssConfig, GptOssForCausalLM

    shape = dict(TINY_SHAPE, vocab_size=vocab_size, head_dim=16, attn_implementation="eager")
    torch.manual_seed(0)
    if kind == "gemma2":
        model = Gemma2ForCausalLM(Gemma2Config(**shape, attn_logit_softcapping=1.0, query_pre_attn_scalar=4))
    else:
        model = GptOssForCausalLM(GptOssConfig(**shape, num_local_experts=4, num_experts_per_tok=2))
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(10.0, 4.0)  # near the logits' log-sum-exps: they matter
    return model.eval()


@pytest.mark.parametrize("kind", ["gemma2", "gpt-oss"])
def test_soft_capped_and_sink_attention_in_the_engine_equals_a_full_prefill(tokenizer, kind, monkeypatch):
    """Models whose attention soft-caps its logits (Gemma 2) or has sinks (gpt-oss) run in the engine, not on
    the per-request path: alone (with a block's pages or none, in chunks) and batched with prefix groups, each
    request's greedy tokens equal the model's own full prefill. Without the cap or the sinks they do not."""
    from serving.engine import graphs

    model = tiny_capped(kind, len(tokenizer))
    assert runner.supports(model) and not graphs.supports(model)
    monkeypatch.setattr(step_plan, "GROUP_MIN_READS", 0)  # every shared prefix read as a group
    pool, batched, full = equal_to_a_full_prefill(model, tokenizer, kind)
    attend = step_plan.StepPlan.attend
    monkeypatch.setattr(
        step_plan.StepPlan, "attend", lambda plan, *a, softcap=None, sinks=None: attend(plan, *a)
    )  # the cap and the sinks ignored
    assert batched() != full
    assert pool.used_pages == pool.shared.page_count()


def test_a_builds_chunks_shrink_as_its_context_grows_while_others_decode(tiny_handle):
    """A background prefill (a block build, serving/backends/transformers/builds.py) paced while others decode takes
    at most `busy_attention_budget` chunk tokens x tokens of context: its chunks shrink late in a long build;
    with nothing else decoding it takes its idle chunk."""
    model = tiny_handle.model
    pool = make_pool(model, mb=64)
    seq = admitted(
        pool,
        model,
        list(range(5, 1005)),
        prefill_chunk_tokens=16,
        idle_chunk_tokens=64,
        busy_attention_budget=2048,
    )
    chunks, position = [], 0
    while seq.prefilling:
        seq.pace(busy=True)
        chunks.append(seq.next_chunk_tokens())
        runner.step(model, pool, [seq], [])
    expected = []
    while position < 1000:
        expected.append(min(16, 1000 - position, max(1, 2048 // max(position, 1))))
        position += expected[-1]
    assert chunks == expected and chunks[:8] == [16] * 8 and chunks[-3:] == [2, 2, 1]  # 2048 // 999 = 2
    seq.pace(busy=False)
    assert seq.chunk == 64
    seq.release()
    assert pool.used_pages == 0


def test_a_reader_releases_the_entry_it_took_not_a_rebuild_under_the_same_id(tiny_handle, tokenizer):
    """Issue 42 item 1: an item dropped while a request reads it and built again under the same id (the
    scheduler's designed path) is a new entry; the first reader's close must not count against the new
    entry's readers, whose own close would then fail an assertion inside the request's `finally`."""
    ids, item = prompts_and_blocks(tiny_handle, tokenizer)[0]
    model = tiny_handle.model
    pool = make_pool(model)
    first = admitted(pool, model, ids, item=item, sampling=Sampling(max_new_tokens=2))
    old = pool.shared._entries[item.item_id]
    assert old.users == 1
    assert pool.shared.drop(item.item_id)  # deleted while `first` reads it
    second = admitted(pool, model, ids, item=item, sampling=Sampling(max_new_tokens=2))
    new = pool.shared._entries[item.item_id]
    assert new is not old and new.users == 1 and old.users == 1
    first.release()  # the first reader lets go of the entry it took, the dropped one
    assert old.users == 0 and new.users == 1
    second.release()
    assert new.users == 0
    assert pool.shared.drop(item.item_id) and pool.used_pages == 0


def test_admission_never_evicts_the_resident_block_it_is_about_to_reuse(tiny_handle, tokenizer):
    """Issue 42 item 2: the item is resident and unread when a request over it is admitted; the reservation
    may evict unread items to make room, and must not evict that one (it then found the item gone and failed
    an assertion: a 500 for a request that fits on retry). Too little room is a PoolFull (429), enough room
    reads the resident pages without copying the item again."""
    from serving.engine.table import PageTable

    ids, item = prompts_and_blocks(tiny_handle, tokenizer)[0]
    shape = PoolShape.of_model(tiny_handle.model, 16)
    item_pages = -(-item.num_tokens // 16)
    pool = PagePool(shape, (item_pages + 4) * shape.page_bytes)
    read = pool.shared.acquire(item)
    pool.shared.release(read.entry)  # resident, read by nobody: evictable
    reuse = (item.num_tokens // 16) * 16
    with pytest.raises(PoolFull):  # 5 own pages wanted, 4 free beside the item
        PageTable.admit(pool, reuse + 5 * 16, item=item, reuse=reuse)
    assert pool.shared.resident(item.item_id) is read.entry and read.entry.users == 0
    table = PageTable.admit(pool, reuse + 4 * 16, item=item, reuse=reuse)
    assert table.pages[: reuse // 16] == read.entry.pages[: reuse // 16] and read.entry.users == 1
    table.close()
    assert read.entry.users == 0 and pool.free_pages == 4

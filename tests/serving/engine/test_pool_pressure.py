"""The engine under a full page pool (issue 42 items 3, 4, 5, 9): pages are taken as a sequence crosses into
them and the newest admitted sequence is preempted (recompute) when the pool runs dry, with the tokens it
would have had alone; a request that waits for pages parks on the pool's changes (no spin, no eviction on
every try) and leaves at once when its caller stops; the free-page runs and the counts that `stats` reads."""

from __future__ import annotations

import threading

import pytest
import torch

from kvmem.kv import Sampling
from serving.engine.batcher import Batcher
from serving.engine.model_loop import ModelLoop
from serving.engine.pages import PagePool, PoolFull, PoolShape
from serving.engine.sequence import AdmissionWait, EngineSequence, admit
from serving.engine.table import PageTable
from tests.conftest import prompts_and_blocks


def request_steps(pool, model, ids, item, max_new: int, out: list, **kw):
    """A request as the backend runs one (steps.py, reduced): admitted, then its tokens; its pages back at
    the end."""
    seq = None
    try:
        for seq in admit(
            pool,
            model,
            ids,
            item=item,
            max_new_tokens=max_new,
            sampling=Sampling(max_new_tokens=max_new),
            **kw,
        ):
            if isinstance(seq, AdmissionWait):
                yield seq
        if not isinstance(seq, EngineSequence):
            seq = None
            return
        token = yield seq
        while token is not None:
            out.append(token)
            token = yield
    finally:  # admission that waited, then raised PoolFull, left an AdmissionWait here: nothing to release
        if isinstance(seq, EngineSequence):
            seq.release()


def run_batched(pool, model, requests, max_new: int, chunk: int = 32):
    """Every request admitted at once into one Batcher (oldest first), stepped until all are done: their
    tokens, their sequences, and the most members that held pages in one step."""
    batcher = Batcher(prefill_budget_tokens=chunk)
    outs, seqs = [], []
    for ids, item in requests:
        out: list[int] = []
        steps = request_steps(pool, model, ids, item, max_new, out, prefill_chunk_tokens=chunk)
        seq = next(steps)
        assert isinstance(seq, EngineSequence), "every prompt fits the pool at admission"
        batcher.add(seq, steps)
        outs.append(out)
        seqs.append(seq)
    most = 0
    while len(batcher):
        most = max(most, sum(1 for s in seqs if not s.finished and not s.preempted))
        batcher.step()
        for s in seqs:  # no page a sequence holds (a block's, its own) was freed from under it
            assert all(pool.refs(p) >= 1 for p in s.table.pages)
    return outs, seqs, most


def test_a_pool_that_holds_some_growing_requests_completes_all_with_their_tokens_alone(
    tiny_handle, tokenizer
):
    """Issue 42 item 3: three requests of different lengths (two over blocks) whose prompts fit the pool
    together but whose replies do not: all are admitted at once (pages were reserved for prompt + max_tokens
    up front, so the pool ran them one at a time), the newest admitted is preempted when the pool runs dry and
    prefilled again later, and every request's greedy tokens equal its tokens alone. The blocks' pages are
    never freed from under their readers, and no page leaks."""
    model = tiny_handle.model
    cases = prompts_and_blocks(tiny_handle, tokenizer)
    requests = [cases[2], cases[3], cases[0]]  # a short block, no block, a long block
    max_new = 64
    shape = PoolShape.of_model(model, 16)
    big = PagePool(shape, 256 * shape.page_bytes)
    alone = [run_batched(big, model, [r], max_new)[0][0] for r in requests]
    pt = 16
    items = sum(-(-item.num_tokens // pt) for _, item in requests if item is not None)
    reused = [len(item.token_ids) // pt * pt if item is not None else 0 for _, item in requests]
    own = [-(-len(ids) // pt) - r // pt for (ids, _), r in zip(requests, reused, strict=True)]
    grown = [-(-(len(ids) + max_new) // pt) - r // pt for (ids, _), r in zip(requests, reused, strict=True)]
    num_pages = items + sum(own) + 2  # the blocks and every prompt fit at once, their replies do not
    assert num_pages < items + sum(grown) - 4
    pool = PagePool(shape, num_pages * shape.page_bytes)
    outs, seqs, most = run_batched(pool, model, requests, max_new)
    assert outs == alone
    assert most == 3  # all three ran at once
    assert [s.num_preemptions for s in seqs] == [0, 1, 1]  # the newest admitted, then the next newest
    assert not pool.preempted and pool.used_pages == pool.shared.page_count()
    for _, item in requests:  # read by nobody now (a block whose readers ended may have been evicted)
        entry = pool.shared.resident(item.item_id) if item is not None else None
        assert entry is None or entry.users == 0


def test_a_preempted_sequence_keeps_the_block_it_reads_and_its_copied_page(tiny_handle, tokenizer):
    """A preempted sequence gives back its own pages only: the block's pages it references and the page it
    copied (its prompt leaves the block mid-page) stay, and its item stays held, so a delete of the item while
    it waits cannot free a page it reads again."""
    model = tiny_handle.model
    ids, item = prompts_and_blocks(tiny_handle, tokenizer)[0]
    pool = PagePool(PoolShape.of_model(model, 16), 64 * PoolShape.of_model(model, 16).page_bytes)
    seq = next(admit(pool, model, ids, item=item, max_new_tokens=4, sampling=Sampling(max_new_tokens=4)))
    reuse, pt = seq.table.reused, 16
    assert reuse % pt, "the prompt leaves the block mid-page (a copied page)"
    kept = list(seq.table.pages[: -(-reuse // pt)])
    entry = pool.shared.resident(item.item_id)
    seq.preempt()
    assert (
        seq.table.pages == kept
        and seq.table.length == seq.position == reuse
        and pool.preempted == {seq.table}
    )
    assert entry.users == 1 and seq._prefill == list(ids[reuse:])
    pool.shared.drop(item.item_id)  # deleted while it waits: the pages it reads stay with it
    assert all(pool.refs(p) >= 1 for p in kept)
    assert seq.readmit() and not pool.preempted and len(seq.table.pages) == -(-len(ids) // pt)
    seq.release()
    assert entry.users == 0 and pool.used_pages == 0


def test_a_new_request_waits_while_a_preempted_one_does(tiny_handle, tokenizer):
    """Preempted sequences are admitted again before any new request: admission refuses while one waits."""
    model = tiny_handle.model
    ids = prompts_and_blocks(tiny_handle, tokenizer)[3][0]
    pool = PagePool(PoolShape.of_model(model, 16), 64 * PoolShape.of_model(model, 16).page_bytes)
    seq = next(admit(pool, model, ids, max_new_tokens=4, sampling=Sampling(max_new_tokens=4)))
    seq.preempt()
    with pytest.raises(PoolFull, match="1 preempted sequences wait for pages first"):
        PageTable.admit(pool, len(ids))
    seq.release()  # closed while preempted: no longer waited for
    assert not pool.preempted
    PageTable.admit(pool, len(ids)).close()
    assert pool.used_pages == 0
    seq = next(admit(pool, model, ids, max_new_tokens=4, sampling=Sampling(max_new_tokens=4)))
    seq.preempt()  # then cancelled: its turn ends and its session keeps what it has
    kept = seq.keep_table()
    assert not pool.preempted and kept.length == 0
    PageTable.admit(pool, len(ids)).close()
    kept.close()
    assert pool.used_pages == 0


@pytest.mark.parametrize("over_the_block", [False, True])
def test_a_waiting_request_parks_until_pages_are_freed_and_evicts_nothing_meanwhile(
    tiny_handle, tokenizer, over_the_block
):
    """Issue 42 item 4: a request that finds no room waits on the pool's changes: the model loop does not try
    it again (it tried 59,296 times a second, evicting every unread block on each try) until pages are freed,
    and a try that could not succeed even by evicting every unread item evicts none. Over the block: its try
    holds the resident block and lets it go, which is no room for it to wake on."""
    model = tiny_handle.model
    cases = prompts_and_blocks(tiny_handle, tokenizer)
    ids, item = cases[1][0], cases[2][1]
    shape = PoolShape.of_model(model, 16)
    item_pages = -(-item.num_tokens // 16)
    assert item_pages < -(-len(ids) // 16) <= item_pages + 8
    pool = PagePool(shape, (item_pages + 8) * shape.page_bytes)
    read = pool.shared.acquire(item)
    pool.shared.release(read.entry)  # resident, unread: evictable
    held = pool.alloc(8)  # all the other pages: the prompt needs more than evicting the item frees
    tries = []
    real = PageTable.admit

    def counted(*args, **kwargs):
        tries.append(1)
        return real(*args, **kwargs)

    loop = ModelLoop()
    out: list[int] = []
    done = threading.Event()

    if over_the_block:
        ids = cases[2][0]  # its prompt over the block, with more own pages than are free

    def steps():
        yield from request_steps(pool, model, ids, item if over_the_block else None, 3, out, wait_s=600)
        done.set()

    PageTable.admit = staticmethod(counted)
    try:
        loop.start(steps())
        for _ in range(3):  # turns of the loop come and go; the parked request is not tried again
            loop.call(lambda: None)
        assert len(tries) == 1
        assert pool.shared.resident(item.item_id) is read.entry  # not evicted for a try that could not fit
        pool.release(held)  # room: the pool wakes the loop
        assert done.wait(60)
        assert len(tries) == 2 and len(out) == 3
    finally:
        PageTable.admit = staticmethod(real)
        loop.close()


def test_a_request_whose_caller_stops_while_it_waits_leaves_at_once(tiny_handle, tokenizer):
    """Issue 42 item 5: a request waiting for pages whose caller stops (a client that disconnected) leaves the
    wait when woken, not after `wait_s`, without a sequence."""
    model = tiny_handle.model
    ids = prompts_and_blocks(tiny_handle, tokenizer)[3][0]
    pool = PagePool(PoolShape.of_model(model, 16), 8 * PoolShape.of_model(model, 16).page_bytes)
    held = pool.alloc(8)
    cancel = threading.Event()
    loop = ModelLoop()
    left = threading.Event()
    out: list[int] = []

    def steps():
        yield from request_steps(pool, model, ids, None, 3, out, wait_s=600, should_stop=cancel.is_set)
        left.set()

    try:
        loop.start(steps())
        loop.call(lambda: None)
        assert not left.is_set()
        cancel.set()
        loop.wake()
        assert left.wait(60) and out == []
    finally:
        loop.close()
    pool.release(held)
    assert pool.used_pages == 0


def test_free_runs_take_one_run_and_merge_what_is_freed():
    """Issue 42 item 9: the free pages as runs (no sort of the free list per allocation): a multi-page take is
    one run when one is long enough, a one-page take uses a lone free page first, freed pages merge."""
    from serving.engine.free_runs import FreeRuns

    runs = FreeRuns(10)
    assert runs.take(3) == [0, 1, 2] and runs.take(1) == [3] and runs.take(1) == [4]
    runs.add(1)
    runs.add(3)  # two lone pages; 5..9 one run
    assert runs.count == 7
    assert runs.take(1) == [1]  # a lone page, not a piece of the long run
    assert runs.take(2) == [5, 6]  # from the run, not the lone page 3
    runs.add(4)
    runs.add(2)  # 2, 3, 4 merge into one run, as long as 7..9
    assert runs.take(3) == [2, 3, 4] and runs.take(3) == [7, 8, 9] and runs.count == 0


def test_stats_count_shared_pages_without_a_pass_over_them(tiny_handle, tokenizer):
    """`stats` reads counts kept as entries come and go: a knowledge child's pages it shares with its parent
    count once; dropping gives the counts back."""
    model = tiny_handle.model
    ids, item = prompts_and_blocks(tiny_handle, tokenizer)[0]
    pool = PagePool(PoolShape.of_model(model, 16), 64 * PoolShape.of_model(model, 16).page_bytes)
    read = pool.shared.acquire(item)
    pages = -(-item.num_tokens // 16)
    assert (
        pool.stats()["pages_shared"] == pages == pool.shared.page_count() and pool.shared.unread_pages() == 0
    )
    pool.shared.release(read.entry)
    assert pool.shared.unread_pages() == pages
    pool.shared.drop(item.item_id)
    assert pool.stats()["pages_shared"] == 0 == pool.shared.unread_pages() and pool.used_pages == 0


def test_a_gpu_pool_is_a_fraction_of_the_free_device_memory():
    """Issue 42 item 4: without a size, a GPU's pool is `fraction` of the device memory free once the model
    is loaded, less the KV store's device tier (as vLLM's gpu_memory_utilization); a 1 GiB pool (the old
    default) held 8,192 tokens of an 8B llama in bf16."""
    import torch

    from serving.engine.pages import pool_bytes_on_device

    llama_8b = PoolShape(layers=32, kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    assert (1 << 30) // llama_8b.page_bytes * llama_8b.page_tokens == 8192
    gib = 1 << 30
    free = 125 * gib  # an H200 (141 GiB) after 16 GiB of weights
    assert pool_bytes_on_device(free, 0.8, 2 * gib) == int(123 * gib * 0.8)
    assert pool_bytes_on_device(free, 0.8, 2 * gib) // llama_8b.page_bytes * 16 == 806_080  # tokens
    assert pool_bytes_on_device(gib, 0.8, 2 * gib) == 0  # nothing left: PagePool refuses it by name
    for bad in (0, 1.5):
        with pytest.raises(ValueError, match=r"fraction of free device memory must be in \(0, 1\]"):
            pool_bytes_on_device(free, bad)


def test_when_nothing_runs_a_younger_preempted_request_holding_pages_fails_for_the_older(
    tiny_handle, tokenizer
):
    """Every member preempted and the oldest cannot get its pages back because a younger one holds pages
    (the block it reads, its copied page): the younger fails with PoolFull and gives them back, and the
    oldest then runs to the end with its tokens alone (nothing runs otherwise: no step would free a page)."""
    model = tiny_handle.model
    cases = prompts_and_blocks(tiny_handle, tokenizer)
    (ids1, item1), (ids2, item2) = cases[0], cases[2]
    shape = PoolShape.of_model(model, 16)
    alone = run_batched(PagePool(shape, 256 * shape.page_bytes), model, [(ids1, item1)], 8)[0][0]
    pool = PagePool(shape, 64 * shape.page_bytes)
    batcher = Batcher(prefill_budget_tokens=32)
    out1, out2 = [], []
    steps1 = request_steps(pool, model, ids1, item1, 8, out1, prefill_chunk_tokens=32)
    steps2 = request_steps(pool, model, ids2, item2, 8, out2, prefill_chunk_tokens=32)
    seq1, seq2 = next(steps1), next(steps2)
    batcher.add(seq1, steps1)
    batcher.add(seq2, steps2)
    seq1.preempt()
    seq2.preempt()
    held = pool.alloc(pool.free_pages)  # another's: no page is free, the blocks are read (not evictable)
    batcher.step()
    assert len(batcher) == 1 and seq2.table._closed and out2 == []  # the younger failed and let go
    assert pool.shared.resident(item2.item_id).users == 0 and seq1.preempted
    while len(batcher):
        batcher.step()
    assert out1 == alone and seq1.num_preemptions == 1
    pool.release(held)
    assert not pool.preempted and pool.used_pages == pool.shared.page_count()


class _Event:
    """A CUDA event as the pool reads one: done once `done` is set; its elapsed time to another in ms."""

    def __init__(self, at_ms: float) -> None:
        self.at_ms, self.done = at_ms, False

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, end: _Event) -> float:
        return end.at_ms - self.at_ms


def test_a_gpu_copys_time_is_counted_from_its_events_once_it_has_run():
    """On a GPU a copy into pages is non_blocking: its time is read from the CUDA events recorded around it,
    in order, once the later one has run (copied_seconds, and copy_sample, the rate load_costs.py reads);
    until then neither its seconds nor its bytes are in the sample. On a CPU the thread's time is counted at
    once (the bytes of a CPU copy are in the sample as it returns)."""
    pool = PagePool(PoolShape(2, 1, 4, torch.float32, page_tokens=4), 1 << 16)
    slots = pool.slots(pool.alloc(1), 0, 4)
    pool.write(slots, torch.ones(2, 2, 1, 4, 4))
    cpu_bytes, cpu_s = pool.copy_sample()
    assert pool.copies == 1 and cpu_bytes == pool.copied_bytes == 2 * 2 * 4 * 4 * 4 and cpu_s > 0
    first = (_Event(0.0), _Event(4.0), 1000)
    second = (_Event(10.0), _Event(12.0), 500)
    pool.copy_times._timing.extend([first, second])
    assert pool.copy_sample() == (cpu_bytes, cpu_s) and pool.copied_seconds == cpu_s  # neither has run
    second[1].done = True  # read in order: the second waits for the first
    assert pool.copy_sample() == (cpu_bytes, cpu_s)
    first[1].done = True
    assert pool.copy_sample() == (cpu_bytes + 1500, pytest.approx(cpu_s + 0.006))
    assert pool.copied_seconds == pytest.approx(cpu_s + 0.006) and not pool.copy_times._timing

"""The scheduler on a real plaintext store (hash embedder) with a recording fake builder and an injected
clock: exact heat values, exact plans under caps, append-only growth, hysteresis, invalidation before the
store call returns, a delete racing a rebuild, the overall byte cap."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from datetime import datetime, timezone

import pytest

from kvmem.text import HashEmbedder, MemoryStore
from scheduler import AccessEvent, BlockMaker, Scheduler, SchedulerConfig
from scheduler.heat import HeatTable
from scheduler.policy import (
    BlockDecision,
    BlockUsage,
    Candidate,
    blocks_to_evict,
    choose_block,
    distill_candidates,
)


class Clock:
    def __init__(self, t: float = 1_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def dt(self) -> datetime:
        return datetime.fromtimestamp(self.t, timezone.utc)


@dataclass(frozen=True)
class Built:
    item_id: str
    num_tokens: int
    num_bytes: int
    token_ids: tuple[int, ...] = ()


class FakeBuilder(BlockMaker):
    def __init__(self):
        self.builds: list[tuple[str, tuple[str, ...]]] = []
        self.dropped: list[str] = []
        self.warmed: list[str] = []
        self.gate: threading.Event | None = None
        self.entered = threading.Event()

    def ready(self) -> bool:
        return True

    def build_block(self, user_id, texts, memory_ids):
        self.entered.set()
        if self.gate is not None:
            self.gate.wait(10)
        self.builds.append((user_id, tuple(memory_ids)))
        return Built(f"item-{len(self.builds)}", sum(len(t.split()) for t in texts), 100 * len(texts))

    def drop_block(self, item_id):
        self.dropped.append(item_id)

    def warm_block(self, item_id):
        self.warmed.append(item_id)


def words(n: int, tag: str) -> str:
    return " ".join([tag] * n)


@pytest.fixture()
def env(tmp_path):
    clock = Clock()
    store = MemoryStore(tmp_path / "m.sqlite", embedder=HashEmbedder(), clock=clock.dt)
    builder = FakeBuilder()

    def make(**cfg):
        sched = Scheduler(
            SchedulerConfig(**{"half_life_s": 100.0, "recency_prior": 1.0, "use_weight": 2.0, **cfg}),
            store,
            builder,
            lambda text: len(text.split()),
            clock=clock,
        )
        sched.start(thread=False)  # store events, tasks run by run_pending
        return sched

    yield clock, store, builder, make
    store.close()


def test_heat_decays_exactly_and_persists(tmp_path):
    path = tmp_path / "heat.sqlite"
    heat = HeatTable(path, half_life_s=10.0, use_weight=2.0, recency_prior=0.5)
    heat.seen("u", "a", 0.0)
    heat.record("u", ["a", "b"], ["a"], 10.0)
    stats = heat.stats("u")
    assert stats["a"].score_now(10.0, 10.0) == 0.25 + 3.0
    assert stats["b"].score_now(30.0, 10.0) == 0.25
    assert (stats["a"].hits, stats["a"].uses, stats["b"].uses, stats["a"].last_access) == (1, 1, 0, 10.0)
    heat.close()
    again = HeatTable(path, half_life_s=10.0, use_weight=2.0, recency_prior=0.5)
    assert again.stats("u") == stats and again.stats("other") == {}


def test_choose_block_appends_keeps_prefix_and_rebuilds_only_past_hysteresis():
    c = [Candidate("a", 5.0, 10), Candidate("b", 4.0, 10), Candidate("c", 3.0, 10), Candidate("d", 0.5, 10)]
    # current [a, d]: a stays as the prefix, the cold tail d gives way to b (90 > 1.05 x 55 tokens served)
    assert choose_block(c, ("a", "d"), 20, 1.05) == BlockDecision(("a", "b"), "truncate", 90.0)
    assert choose_block(c, (), 30, 1.5).memory_ids == ("a", "b", "c")
    assert choose_block(c, (), 30, 1.5).action == "rebuild"
    # current [c, d] keeps its prefix; a fills the room that is left; b does not fit
    d = choose_block(c, ("c", "d"), 30, 1.5)
    assert (d.memory_ids, d.action) == (("c", "d", "a"), "append")
    # the ideal (a, b) = 90 vs appended (d, a) = 55 -> more than 1.5x: rebuild in heat order
    d = choose_block(c, ("d",), 20, 1.5)
    assert (d.memory_ids, d.action) == (("a", "b"), "rebuild")
    assert choose_block(c, ("a", "b", "c"), 30, 1.5).action == "keep"
    assert choose_block(c, ("gone",), 30, 1.5).action == "rebuild"  # a deleted memory forces a rebuild
    assert choose_block(c, ("a",), 5, 1.5) == choose_block(c, ("a",), 5, 1.5)
    assert choose_block(c, ("a",), 5, 1.5).action == "drop"  # cap too small for any memory


def test_choose_block_values_a_block_by_the_tokens_it_serves():
    # a warm 30-token memory fills the block and serves 2.5 x 30 = 75; the three short hot memories that would
    # replace it serve 5 x 10 + 4 x 10 + 1 x 10 = 100: hotter per memory (10 vs 2.5), but not 1.5x more tokens
    c = [Candidate("a", 5.0, 10), Candidate("b", 4.0, 10), Candidate("c", 1.0, 10), Candidate("x", 2.5, 30)]
    assert choose_block(c, ("x",), 30, 1.5) == BlockDecision(("x",), "keep", 75.0)
    assert choose_block(c, ("x",), 30, 1.2) == BlockDecision(("a", "b", "c"), "rebuild", 100.0)


def test_new_user_gets_its_newest_memories_then_hot_ones_are_appended(env):
    clock, store, builder, make = env
    sched = make(user_block_tokens=6)
    ids = []
    for i in range(4):
        ids.append(store.add("alice", words(2, f"m{i}"))[0].id)
        clock.t += 10
    assert sched.get("alice").block is None and sched.get("unknown").block is None
    sched.run_pending()
    plan = sched.get("alice")
    # the newest that fit (3 x 2 tokens = cap), laid out longest unchanged first
    assert plan.block.memory_ids == (ids[1], ids[2], ids[3])
    assert builder.builds == [("alice", (ids[1], ids[2], ids[3]))]
    # ids[0] gets hot but there is no room: the gain (hysteresis) is too small to reorder
    sched.record_access(AccessEvent("alice", (ids[0],), (), clock.t))
    sched.run_pending()
    assert sched.get("alice").block.memory_ids == (ids[1], ids[2], ids[3]) and len(builder.builds) == 1
    # now it is used again and again: worth > 1.5x the current block -> the cold memory (ids[1]) is replaced;
    # laid out first (longest unchanged), nothing before it is kept: the block is rebuilt, in the same order
    for _ in range(5):
        sched.record_access(AccessEvent("alice", (ids[0],), (ids[0],), clock.t))
    sched.run_pending()
    assert sched.get("alice").block.memory_ids == (ids[0], ids[2], ids[3])
    assert builder.dropped == ["item-1"]


def test_update_or_delete_stops_serving_before_the_store_call_returns(env):
    clock, store, builder, make = env
    sched = make()
    a, b = (m.id for m in store.add("alice", texts=["cat named Miso", "lives in Lisbon"]))
    sched.get("alice")
    sched.run_pending()
    assert sched.get("alice").covered_ids == {a, b}
    store.update("alice", a, text="dog named Rex")
    assert sched.get("alice").block is None and builder.dropped == ["item-1"]  # before any worker ran
    sched.run_pending()
    assert sched.get("alice").covered_ids == {a, b}
    store.delete("alice", b)
    assert sched.get("alice").block is None
    sched.run_pending()
    assert sched.get("alice").block.memory_ids == (a,)
    assert builder.builds[-1] == ("alice", (a,))


def test_each_memory_version_is_counted_once(env):
    # access events refresh the block while the next request's forward runs: no re-tokenizing per event
    clock, store, builder, _ = env
    counted: list[str] = []

    def count(text: str) -> int:
        counted.append(text)
        return len(text.split())

    sched = Scheduler(SchedulerConfig(user_block_tokens=5), store, builder, count, clock=clock)
    sched.start(thread=False)
    a, b = (m.id for m in store.add("alice", texts=["cat named Miso", "lives in Lisbon"]))
    sched.run_pending()
    assert sorted(counted) == ["cat named Miso", "lives in Lisbon"]
    for _ in range(3):
        sched.record_access(AccessEvent("alice", (a, b), (b,), clock.t))
        sched.run_pending()
    assert len(counted) == 2
    store.update("alice", a, text="dog")  # a new version is counted again, and its new size lets both fit
    sched.run_pending()
    assert counted[2:] == ["dog"] and set(sched.get("alice").block.memory_ids) == {a, b}
    store.delete("alice", b)
    sched.run_pending()
    assert len(counted) == 3 and sched.worker._token_counts["alice"] == {a: (2, 1)}


def test_memory_deleted_during_a_rebuild_is_never_published(env):
    clock, store, builder, make = env
    sched = make()
    a, b = (m.id for m in store.add("alice", texts=["cat named Miso", "lives in Lisbon"]))
    builder.gate = threading.Event()
    sched.get("alice")
    worker = threading.Thread(target=sched.run_pending)
    worker.start()
    assert builder.entered.wait(10)  # the build of [a, b] is in flight
    store.delete("alice", b)
    builder.gate.set()
    worker.join(10)
    sched.run_pending()
    published = sched.get("alice").block
    assert published.memory_ids == (a,)
    assert sched.stats().discarded_builds == 1 and "item-1" in builder.dropped
    # the race's bookkeeping is gone with the refreshes: it is kept only while one is in flight
    assert sched.worker._changes == {} and sched.worker._in_flight == {}


def test_store_changes_keep_no_per_user_state_once_refreshed(env):
    clock, store, builder, make = env
    sched = make()
    for n in range(5):
        user = f"user-{n}"
        [m] = store.add(user, texts=[f"fact {n}"])
        sched.get(user)
        sched.run_pending()
        store.update(user, m.id, text=f"fact {n} changed")
        store.delete(user, m.id)
        sched.run_pending()
    assert sched.worker._changes == {} and sched.worker._in_flight == {}


def test_overall_byte_cap_drops_the_coldest_block(env):
    clock, store, builder, make = env
    sched = make(total_block_bytes=250)
    alice = [m.id for m in store.add("alice", texts=["one a", "two a"])]
    store.add("bob", texts=["one b", "two b"])
    sched.get("alice")
    sched.get("bob")
    sched.run_pending()
    # equal heat and recency: the tie goes by user id, so alice's block leaves for bob's
    assert (sched.get("alice").block, sched.get("bob").block.item_id) == (None, "item-2")
    sched.record_access(AccessEvent("alice", tuple(alice), tuple(alice), clock.t))
    sched.run_pending()
    assert (sched.get("alice").block.item_id, sched.get("bob").block) == ("item-3", None)
    assert sched.stats().block_bytes == 200 and builder.dropped == ["item-1", "item-2"]


def test_overall_byte_cap_keeps_the_block_that_serves_more_tokens(env):
    clock, store, builder, make = env
    sched = make(total_block_bytes=150)
    store.add("alice", words(10, "long"))
    store.add("bob", words(2, "short"))
    sched.get("alice")
    sched.get("bob")
    sched.run_pending()
    # equal heat, recency and bytes (one memory each), but alice's block saves 10 tokens a hit and bob's 2
    assert sched.get("alice").block.item_id == "item-1" and sched.get("bob").block is None
    assert builder.dropped == ["item-2"]


def test_blocks_to_evict_and_distill_candidates_are_exact():
    blocks = [BlockUsage("a", 100, 10.0, 5.0), BlockUsage("b", 100, 1.0, 9.0), BlockUsage("c", 100, 1.0, 1.0)]
    assert blocks_to_evict(blocks, 150) == ["c", "b"]
    assert blocks_to_evict(blocks, None) == [] and blocks_to_evict(blocks, 300) == []
    heat = HeatTable(None, half_life_s=10.0, use_weight=1.0, recency_prior=0.0)
    heat.seen("u", "old", 0.0)
    heat.seen("u", "new", 90.0)
    for t in range(5):
        heat.record("u", ["old", "new"], ["old", "new"], 91.0 + t)
    assert distill_candidates(heat.stats("u"), 100.0, min_uses=5, min_stable_s=50.0) == ["old"]


def test_bad_config_names_the_field():
    with pytest.raises(ValueError, match="half_life_s"):
        SchedulerConfig(half_life_s=0)
    with pytest.raises(ValueError, match="supported: heat, lfu, lru"):
        SchedulerConfig(promotion="random")


def test_session_start_builds_then_warms_the_block(env):
    clock, store, builder, make = env
    sched = make()
    store.add("alice", texts=["cat named Miso"])
    sched.session_start("alice")
    sched.run_pending()
    assert builder.builds[0][0] == "alice" and builder.warmed == ["item-1"]
    sched.session_start("alice")
    sched.run_pending()
    assert len(builder.builds) == 1 and builder.warmed == ["item-1", "item-1"]  # no rebuild, warmed again


class StoringBuilder(FakeBuilder):
    """Blocks stored by content (user, memory ids), as in a data dir replicas share: a block built once is
    found again by any scheduler, and only a block not stored yet costs a prefill."""

    finds_stored_blocks = True

    def __init__(self):
        super().__init__()
        self.stored: dict[tuple[str, tuple[str, ...]], Built] = {}
        self.prefills = 0

    def build_block(self, user_id, texts, memory_ids):
        key = (user_id, tuple(memory_ids))
        if key not in self.stored:
            self.prefills += 1
            self.stored[key] = Built(f"item-{len(self.stored) + 1}", 2 * len(texts), 100 * len(texts))
        self.builds.append(key)
        return self.stored[key]

    def find_block(self, user_id, texts, memory_ids):
        return self.stored.get((user_id, tuple(memory_ids)))

    def stored_memory_ids(self, user_id):
        return [ids for user, ids in reversed(self.stored) if user == user_id]  # newest first


def test_a_user_new_to_a_scheduler_is_served_the_stored_block_not_a_prefill(tmp_path):
    """Failover: replica B takes over a user whose block replica A built (hot memories since then would order
    a new block differently); B publishes A's stored block, found by its content, and prefills nothing."""
    clock = Clock()
    store = MemoryStore(tmp_path / "m.sqlite", embedder=HashEmbedder(), clock=clock.dt)
    builder = StoringBuilder()

    def replica() -> Scheduler:
        config = SchedulerConfig(half_life_s=100.0, recency_prior=1.0, use_weight=2.0, user_block_tokens=6)
        sched = Scheduler(
            config, store, builder, lambda t: len(t.split()), clock=clock, heat_path=tmp_path / "heat.sqlite"
        )
        sched.start(thread=False)
        return sched

    a = replica()
    ids = []
    for i in range(4):
        ids.append(store.add("alice", words(2, f"m{i}"))[0].id)
        clock.t += 10
    a.get("alice")
    a.run_pending()
    built = a.get("alice").block
    assert built.memory_ids == (ids[1], ids[2], ids[3]) and builder.prefills == 1
    a.record_access(AccessEvent("alice", (ids[0],), (), clock.t))  # hotter now, not enough to reorder
    a.run_pending()
    assert a.get("alice").block.item_id == built.item_id
    a.stop()

    b = replica()  # A died; the router sends alice here
    first = b.get("alice").block  # her first read on B already serves A's stored block
    assert first.item_id == built.item_id and first.memory_ids == built.memory_ids
    b.run_pending()  # her queued refresh keeps it
    assert b.get("alice").block.item_id == built.item_id and builder.prefills == 1
    b.stop()
    store.close()


def test_a_second_read_during_the_first_reads_restore_waits_for_it(tmp_path):
    """Two requests of a user new to this replica at once (after a failover): the second read waits for the
    first read's restore and serves the stored block too, instead of text (it saw the user registered with an
    empty plan before)."""
    clock = Clock()
    store = MemoryStore(tmp_path / "m.sqlite", embedder=HashEmbedder(), clock=clock.dt)
    builder = StoringBuilder()
    config = SchedulerConfig(half_life_s=100.0, recency_prior=1.0, use_weight=2.0, user_block_tokens=6)

    def replica() -> Scheduler:
        sched = Scheduler(config, store, builder, lambda t: len(t.split()), clock=clock)
        sched.start(thread=False)
        return sched

    a = replica()
    store.add("alice", words(2, "m0"))
    a.get("alice")
    a.run_pending()
    built = a.get("alice").block
    a.stop()

    b = replica()
    entered, release = threading.Event(), threading.Event()
    find = builder.find_block

    def slow_find(*args):
        entered.set()
        release.wait(10)
        return find(*args)

    builder.find_block = slow_find
    blocks = {}
    first = threading.Thread(target=lambda: blocks.__setitem__("first", b.get("alice").block))
    first.start()
    assert entered.wait(10)
    second = threading.Thread(target=lambda: blocks.__setitem__("second", b.get("alice").block))
    second.start()
    second.join(0.3)
    assert second.is_alive()  # waiting for the restore under way
    release.set()
    first.join(10)
    second.join(10)
    assert blocks["first"].item_id == blocks["second"].item_id == built.item_id
    b.stop()
    store.close()


class CuttingBuilder(FakeBuilder):
    """Keeps each item's memory ids and cuts a prefix from one as a new item (`fail`: the cut raises)."""

    def __init__(self):
        super().__init__()
        self.items: dict[str, tuple[str, ...]] = {}
        self.cuts: list[tuple[str, tuple[str, ...]]] = []
        self.fail = False

    def build_block(self, user_id, texts, memory_ids):
        built = super().build_block(user_id, texts, memory_ids)
        self.items[built.item_id] = tuple(memory_ids)
        return built

    def cut_block(self, item_id, memory_ids, texts):
        if self.fail:
            raise OSError("disk full")
        assert self.items[item_id][: len(memory_ids)] == tuple(memory_ids)
        self.cuts.append((item_id, tuple(memory_ids)))
        return Built(f"cut-{len(self.cuts)}", sum(len(t.split()) for t in texts), 100 * len(texts))


def three_memories(clock, store) -> list[str]:
    ids = []
    for name in ("a", "b", "c"):
        ids.append(store.add("alice", words(2, name))[0].id)
        clock.t += 10
    return ids


def test_a_change_cuts_the_block_before_it_and_the_rebuild_appends_to_the_cut(tmp_path):
    """The block is laid out longest unchanged first. Updating its second memory: before the store call returns
    the block is cut after its first (served from the cut, no build), and the rebuild keeps the cut as its
    prefix, the changed memory last; a change of the first memory leaves nothing to cut; a failing cut serves
    text and rebuilds in full."""
    clock = Clock()
    store = MemoryStore(tmp_path / "m.sqlite", embedder=HashEmbedder(), clock=clock.dt)
    builder = CuttingBuilder()
    config = SchedulerConfig(half_life_s=100.0, recency_prior=1.0, use_weight=2.0)
    sched = Scheduler(config, store, builder, lambda t: len(t.split()), clock=clock)
    sched.start(thread=False)
    a, b, c = three_memories(clock, store)
    sched.get("alice")
    sched.run_pending()
    assert sched.get("alice").block.memory_ids == (a, b, c)
    store.update("alice", b, text=words(2, "B"))
    plan = sched.get("alice")  # before any worker ran
    assert plan.block.memory_ids == (a,) and plan.block.item_id == "cut-1"
    assert plan.block.texts == (words(2, "a"),)
    assert builder.cuts == [("item-1", (a,))] and builder.dropped == ["item-1"]
    assert len(builder.builds) == 1 and sched.stats().cuts == 1
    sched.run_pending()
    assert sched.get("alice").block.memory_ids == (a, c, b)  # over the cut, the changed memory last
    assert builder.builds[-1] == ("alice", (a, c, b)) and builder.dropped == ["item-1", "cut-1"]
    rebuilt = sched.get("alice").block.item_id
    clock.t += 10  # after b's change (at equal times the memory ids would order them)
    store.update("alice", a, text=words(2, "A"))  # the first memory: nothing before it to keep
    assert sched.get("alice").block is None and len(builder.cuts) == 1 and builder.dropped[-1] == rebuilt
    sched.run_pending()
    assert sched.get("alice").block.memory_ids == (c, b, a)
    builder.fail = True
    store.delete("alice", b)
    assert sched.get("alice").block is None and sched.stats().cuts == 1  # logged, text served
    sched.run_pending()
    assert sched.get("alice").block.memory_ids == (c, a)
    sched.stop()
    store.close()


def test_a_cut_is_served_only_when_the_fence_moved_by_this_change_alone(tmp_path):
    """With replicas: the cut holds memories read when the block was built; if another replica changed any
    memory of the user since (the fence moved by more than this change's bump), the cut is deleted, not
    served, and the rebuild reads the memories again."""
    from tests.scheduler.test_replicas import SharedFence

    clock = Clock()
    store = MemoryStore(tmp_path / "m.sqlite", embedder=HashEmbedder(), clock=clock.dt)
    builder, fence = CuttingBuilder(), SharedFence()
    sched = Scheduler(SchedulerConfig(), store, builder, lambda t: len(t.split()), clock=clock, fence=fence)
    sched.start(thread=False)
    a, b, c = three_memories(clock, store)
    sched.get("alice")
    sched.run_pending()
    first, second = sched.get("alice").block.memory_ids[:2]
    store.update("alice", second, text=words(2, "changed"))
    assert sched.get("alice").block.memory_ids == (first,) and fence.gen == {
        "alice": 1
    }  # adds do not bump it
    sched.run_pending()
    first, second = sched.get("alice").block.memory_ids[:2]
    fence.bump("alice")  # another replica changed something meanwhile
    store.update("alice", second, text=words(2, "again"))
    assert sched.get("alice").block is None and builder.dropped[-1] == f"cut-{len(builder.cuts)}"
    assert sched.stats().cuts == 1
    sched.stop()
    store.close()


class AddressedBuilder(CuttingBuilder):
    """Content-addressed as the real store is (an item's id is its memories'), with a hook in the cascade."""

    def __init__(self):
        super().__init__()
        self.during_cascade = None

    def build_block(self, user_id, texts, memory_ids):
        self.builds.append((user_id, tuple(memory_ids)))
        item_id = "blk:" + ",".join(memory_ids)
        self.items[item_id] = tuple(memory_ids)
        return Built(item_id, sum(len(t.split()) for t in texts), 100 * len(texts))

    def cut_block(self, item_id, memory_ids, texts):
        self.cuts.append((item_id, tuple(memory_ids)))
        return Built("blk:" + ",".join(memory_ids), sum(len(t.split()) for t in texts), 100 * len(texts))

    def forget(self, user_id, memory_ids):
        if self.during_cascade is not None:
            self.during_cascade()
        return []


def test_a_refresh_publishing_the_cuts_own_item_during_the_cascade_keeps_it(tmp_path):
    """Items are content-addressed: a refresh that runs while the change's cascade does (an access event) may
    build and publish the very item the change cut. The cut then is not published (a newer plan is), and the
    item is not dropped: it is the one served."""
    clock = Clock()
    store = MemoryStore(tmp_path / "m.sqlite", embedder=HashEmbedder(), clock=clock.dt)
    builder = AddressedBuilder()
    sched = Scheduler(SchedulerConfig(), store, builder, lambda t: len(t.split()), clock=clock)
    sched.start(thread=False)
    a, b, c = three_memories(clock, store)
    sched.get("alice")
    sched.run_pending()
    assert sched.get("alice").block.item_id == f"blk:{a},{b},{c}"
    builder.during_cascade = lambda: sched.worker.refresh("alice")
    store.delete("alice", c)
    builder.during_cascade = None
    plan = sched.get("alice")
    assert plan.block.item_id == f"blk:{a},{b}" and builder.cuts == [(f"blk:{a},{b},{c}", (a, b))]
    assert builder.dropped == [f"blk:{a},{b},{c}"] and sched.stats().cuts == 0  # the refresh published it
    sched.stop()
    store.close()


def test_the_worker_thread_outlives_a_failure_between_its_tasks(env):
    """A store error in the checks between tasks (the adapter poll's fact check) ended the worker's thread:
    no task ran after it. The loop logs it and goes on."""
    import threading

    _clock, store, builder, make = env
    sched = make()
    calls = []

    def checks():
        calls.append(1)
        if len(calls) == 1:
            raise OSError("disk I/O error")

    sched.worker.between_tasks = checks
    store.add("bob", texts=["lives in Lisbon"])
    sched.get("bob")
    stop = threading.Event()
    thread = threading.Thread(target=sched.worker.run, args=(stop,), daemon=True)
    thread.start()
    try:
        for _ in range(200):
            if any(b[0] == "bob" for b in builder.builds):
                break
            thread.join(0.05)
        assert thread.is_alive() and len(calls) >= 2 and any(b[0] == "bob" for b in builder.builds)
    finally:
        stop.set()
        thread.join(5)

"""Caps that the built block, not the policy's estimate, must meet: the per-user byte cap counts the block's
header (system prompt), learned from the first block that overflows; caps too small for any memory mean no
block. Plus the request path's contract: record_access only enqueues, unknown users get an empty plan."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone

import pytest

from kvmem.text import HashEmbedder, MemoryStore
from scheduler import AccessEvent, BlockMaker, Scheduler, SchedulerConfig
from scheduler.policy import user_cap_tokens

HEADER_TOKENS = 2
BYTES_PER_TOKEN = 10


@dataclass(frozen=True)
class Built:
    item_id: str
    num_tokens: int
    num_bytes: int
    token_ids: tuple[int, ...] = ()
    shared_tokens: int = 0


class HeaderBuilder(BlockMaker):
    """Every block carries HEADER_TOKENS besides its memories (one token per word), BYTES_PER_TOKEN each; with
    `shared`, it starts with that many tokens of a shared parent (the knowledge), not counted in its bytes."""

    def __init__(self, shared: int = 0):
        self.builds: list[tuple[str, ...]] = []
        self.dropped: list[str] = []
        self.shared = shared

    def ready(self) -> bool:
        return True

    def build_block(self, user_id, texts, memory_ids):
        self.builds.append(tuple(memory_ids))
        own = HEADER_TOKENS + sum(len(t.split()) for t in texts)
        return Built(f"item-{len(self.builds)}", self.shared + own, own * BYTES_PER_TOKEN, (), self.shared)

    def drop_block(self, item_id):
        self.dropped.append(item_id)


@pytest.fixture()
def env(tmp_path):
    t = [1_000_000.0]
    store = MemoryStore(
        tmp_path / "m.sqlite",
        embedder=HashEmbedder(),
        clock=lambda: datetime.fromtimestamp(t[0], timezone.utc),
    )
    builder = HeaderBuilder()
    ids = []
    for i in range(5):
        ids.append(store.add("alice", f"m{i} x")[0].id)  # 2 tokens each, newest (m4) hottest
        t[0] += 10

    def make(**cfg):
        config = SchedulerConfig(
            **{"half_life_s": 100.0, "recency_prior": 1.0, "bytes_per_token": BYTES_PER_TOKEN, **cfg}
        )
        sched = Scheduler(config, store, builder, lambda text: len(text.split()), clock=lambda: t[0])
        sched.start(thread=False)
        return sched

    yield store, builder, ids, make
    store.close()


def test_user_cap_tokens_is_exact():
    assert user_cap_tokens(100, None, 10) == 100
    assert user_cap_tokens(100, 80, 10) == 8
    assert user_cap_tokens(100, 80, 10, overhead_tokens=2) == 6
    assert user_cap_tokens(5, 80, 10, overhead_tokens=2) == 5
    assert user_cap_tokens(100, 15, 10, overhead_tokens=2) == 0  # never negative
    assert user_cap_tokens(100, 80, 0) == 100  # unknown bytes per token: the token cap alone


def test_byte_cap_counts_the_block_header(env):
    store, builder, ids, make = env
    sched = make(user_block_bytes=80)
    sched.get("alice")
    sched.run_pending()
    # 80 bytes = 8 tokens: 4 memories fit the estimate, but with the 2-token header the block is 100 bytes ->
    # dropped, header learned, 3 memories chosen again (2 + 3 x 2 = 8 tokens = 80 bytes)
    assert builder.builds == [(ids[1], ids[2], ids[3], ids[4]), (ids[2], ids[3], ids[4])]
    assert builder.dropped == ["item-1"]
    block = sched.get("alice").block
    assert (block.item_id, block.memory_ids, block.num_tokens, block.num_bytes) == (
        "item-2",
        (ids[2], ids[3], ids[4]),
        8,
        80,
    )
    sched.record_access(AccessEvent("alice", (ids[4],), (ids[4],), 1_000_050.0))
    sched.run_pending()
    assert len(builder.builds) == 2  # the learned header sticks: no oversized build again


def test_byte_cap_counts_a_blocks_own_tokens_not_the_shared_knowledge(env):
    store, builder, ids, make = env
    builder.shared = 50  # a 50-token knowledge prefix, stored once in its own item
    sched = make(user_block_bytes=80)
    sched.get("alice")
    sched.run_pending()
    # as without knowledge: the 2-token header learned (not 52), 3 memories in 80 bytes of the user's own
    assert builder.builds == [(ids[1], ids[2], ids[3], ids[4]), (ids[2], ids[3], ids[4])]
    block = sched.get("alice").block
    assert (block.memory_ids, block.num_tokens, block.num_bytes) == ((ids[2], ids[3], ids[4]), 58, 80)
    assert sched.worker.header_tokens == HEADER_TOKENS


def test_caps_too_small_mean_no_block(env):
    store, builder, ids, make = env
    sched = make(user_block_tokens=1)  # every memory takes 2 tokens
    sched.get("alice")
    sched.run_pending()
    assert sched.get("alice").block is None and builder.builds == []
    sched = make(user_block_bytes=30)  # 3 tokens: one memory (2) fits the estimate, not with the header
    sched.get("alice")
    sched.run_pending()
    assert sched.get("alice").block is None
    assert builder.builds == [(ids[4],)] and builder.dropped == ["item-1"]
    sched.record_access(AccessEvent("alice", (ids[0],), (ids[0],), 1_000_050.0))
    sched.run_pending()
    assert builder.builds == [(ids[4],)]  # learned: nothing fits, nothing is built


def test_record_access_only_enqueues_and_unknown_user_gets_an_empty_plan(env):
    store, builder, ids, make = env
    sched = make()
    sched.record_access(AccessEvent("alice", (ids[0],), (ids[0],), 1_000_050.0))
    assert sched.heat.stats("alice") == {} and sched.stats().queue_depth == 1 and builder.builds == []
    plan = sched.get("nobody")
    assert (plan.user_id, plan.block, plan.adapter_id, plan.version, plan.covered_ids) == (
        "nobody",
        None,
        None,
        0,
        frozenset(),
    )
    sched.run_pending()
    assert sched.heat.stats("alice")[ids[0]].uses == 1 and sched.get("nobody").block is None
    stats = sched.stats()
    assert (stats.num_blocks, stats.block_memories, stats.tracked_memories, stats.queue_depth) == (1, 5, 5, 0)
    assert (stats.plan_reads, stats.plan_hits) == (2, 0)

"""Heat counts relevance, not injection, through the server's chat path (fake backend + the server's own
scheduler, its tasks run by `flush`): a full block the queries never retrieve gives way to new memories that
are retrieved on every turn. When every block member counted as used on every turn, the block froze."""

from __future__ import annotations

from pathlib import Path

from fastapi.testclient import TestClient

from scheduler import SchedulerConfig, turn_access
from tests.serving.conftest import ALICE, MODEL, make_stack

OLD = ("alice plays the cello at night", "alice grows tomatoes in a tub.")
NEW = ("my parrot Kiwi whistles jazz!!", "my parrot Kiwi eats sunflowers")
TOKENS = 30  # the fake backend counts a character as a token; every memory is this long


def test_turn_access_counts_the_ranked_hits_once_each() -> None:
    event = turn_access("alice", ["b", "a", "b"], at=5.0, session_id="s")
    assert (event.user_id, event.retrieved_ids, event.used_ids, event.at, event.session_id) == (
        "alice",
        ("b", "a"),
        ("b", "a"),
        5.0,
        "s",
    )


def test_a_block_the_queries_never_retrieve_gives_way_to_memories_they_do(tmp_path: Path) -> None:
    assert {len(t) for t in OLD + NEW} == {TOKENS}
    config = SchedulerConfig(
        user_block_tokens=2 * TOKENS,  # two memories fill the block
        half_life_s=1e9,  # no decay to speak of: heat differs only by the turns
        recency_prior=0.25,
        use_weight=2.0,
        hysteresis=1.5,
    )
    stack = make_stack(tmp_path, scheduler_config=config, retrieve_top_k=2, store_turns=False)
    store, scheduler = stack.store, stack.scheduler

    def block() -> tuple[str, ...]:
        plan = scheduler.get("alice")
        return plan.block.memory_ids if plan.block else ()

    with TestClient(stack.app) as client:

        def turn(query: str) -> dict:
            body = {"model": MODEL, "messages": [{"role": "user", "content": query}]}
            out = client.post("/v1/chat/completions", json=body, headers=ALICE).json()
            scheduler.flush()  # the turn's access event, applied before the next turn (the worker's job)
            return out

        old = [m.id for m in store.add("alice", texts=list(OLD))]
        scheduler.flush()
        assert block() == (old[0], old[1])  # longest unchanged first
        for _ in range(2):  # the block's memories are asked about twice: heat 0.25 + 2 x 3 each
            turn("what does alice play and grow?")
        assert block() == (old[0], old[1])

        new = [m.id for m in store.add("alice", texts=list(NEW))]
        scheduler.flush()
        assert block() == (old[0], old[1])  # full, and the new memories have only their prior

        blocks, served = [], []
        for _ in range(5):  # from now on only the parrot is asked about
            out = turn("what does my parrot Kiwi do?")
            served.append([(m["id"], m["tier"]) for m in out["memory"]["used"]])
            blocks.append(block())
    # the parrot memories gain 3 a turn, the block's stay at 6.25: the refilled block is worth more than
    # hysteresis (1.5) x the current one after the 4th turn (0.25 + 4 x 3 = 12.25 > 1.5 x 6.25 = 9.375)
    assert blocks == [(old[0], old[1])] * 3 + [(new[0], new[1])] * 2
    ranked = [h.memory.id for h in store.search("alice", "what does my parrot Kiwi do?", top_k=2)]
    assert set(ranked) == set(new)  # the text part is the search's order, whatever it ranks first
    as_text = [(old[0], "kv"), (old[1], "kv"), *((m, "text") for m in ranked)]
    assert served[:4] == [as_text] * 4
    assert served[4] == [(new[0], "kv"), (new[1], "kv")]
    stats = scheduler.heat.stats("alice")
    assert [(stats[m].hits, stats[m].uses) for m in old + new] == [(2, 2), (2, 2), (5, 5), (5, 5)]
    scheduler.stop()

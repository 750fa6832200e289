"""What a served turn tells the scheduler: the one rule that turns a turn into an `AccessEvent`.

The server's chat path (serving/chat/service.py) and the simulator (benchmarks/tiers/sched_sim.py) both call `turn_access`,
so the policy the simulator measures is the policy the server runs. Knows nothing of prompts, blocks or HTTP.
"""

from __future__ import annotations

from collections.abc import Sequence

from scheduler.heat import AccessEvent


def turn_access(
    user_id: str, retrieved_ids: Sequence[str], *, at: float, session_id: str | None = None
) -> AccessEvent:
    """The access event of one turn: relevance, not injection.

    `retrieved_ids` are what retrieval ranked for the turn's query: the search's hits over *all* the user's
    memories, block members included (serving searches before it drops what the block covers), best first.
    Every hit was in front of the model for this query, in the block or as text, so each counts as retrieved
    and as used (heat 1 + use_weight; `uses` feeds distillation). A block member the search did not rank
    earns nothing: being injected is not evidence the query needed it. Counting injection (every block member
    "used" on every turn, as serving did before) made a block feed itself: its members gained heat each turn
    whether asked about or not, new memories could never clear the hysteresis once it was full, and it froze.
    """
    ids = tuple(dict.fromkeys(retrieved_ids))  # a memory ranked twice is one access
    return AccessEvent(user_id, ids, ids, at, session_id)

"""MemOS's evaluation grid (memory context size x query size) and the synthetic prompts that fill its cells.

Owns the grid's sizes, MemOS's published speedups read from the anchor file (never retyped), and the seeded
memories and user message whose prompt lands on a cell's token counts. Shared by the transformers grid
(ttft_grid.py) and the vLLM one (vllm_ttft.py); knows nothing of models, backends or timing.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from kvmem.kv import PromptLayout

MEMOS_CTX = (583, 2773, 6064)
MEMOS_QUERY = (167, 303, 953)
QUICK_CTX = (583, 2773)
QUICK_QUERY = (167, 303)
# MemOS's published KV-cache TTFT table, copied byte for byte (tests/benchmarks checks it against
# ../shared/anchors when that exists); figures are read from it, never retyped.
MEMOS_ANCHOR = Path(__file__).resolve().parents[1] / "anchors" / "memos_kv_ttft.json"


def memos_speedups(model: str = "Qwen3-8B", path: Path = MEMOS_ANCHOR) -> dict[tuple[int, int], float]:
    """MemOS's speedups (%) for `model`, keyed (ctx, query) as this grid names its cells: the source's query
    sizes 302.7 and 952.7 are averages, rounded to 303 and 953."""
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    return {
        (int(c["ctx_tokens"]), round(c["query_tokens"])): float(c["speedup_pct"])
        for c in cells
        if c["model"] == model
    }


# The target to meet or beat, cell by cell.
MEMOS_QWEN3_8B = memos_speedups()
assert set(MEMOS_QWEN3_8B) == {(c, q) for c in MEMOS_CTX for q in MEMOS_QUERY}, MEMOS_QWEN3_8B

_WORDS = (
    "apartment mortgage renovation kitchen tiles budget contractor garden sister Lisbon marathon violin "
    "allergy peanut teacher daughter birthday October coffee bicycle manager deadline vacation Kyoto "
    "hiking sourdough recipe cat piano dentist insurance neighbour balcony paint flooring"
).split()


def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def memories_for(layout: PromptLayout, target_tokens: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    memories: list[str] = []
    while len(layout.block_ids(memories)) < target_tokens:
        memories.append(
            f"Memory {len(memories) + 1}: the user talked about {_sentence(rng, rng.randint(8, 18))}."
        )
    return memories


def query_for(layout: PromptLayout, memories: list[str], target_tokens: int, seed: int) -> list[dict]:
    """A user message whose prompt remainder after the block is about `target_tokens` tokens."""
    rng = random.Random(seed)
    block_len = len(layout.block_ids(memories))
    parts = ["Given what you know about me, what should I do next?"]
    while True:
        messages = [{"role": "user", "content": " ".join(parts)}]
        if len(layout.prompt(memories, [], messages).ids) - block_len >= target_tokens:
            return messages
        parts.append(f"Also consider the {_sentence(rng, 6)}.")

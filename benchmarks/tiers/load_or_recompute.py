"""Load or recompute (issue 44 item 4), through the production backend: for blocks of --sizes tokens, the time to
the first token of a greedy request whose block is in the page pool, in host RAM, on disk (the load forced),
and of the same prompt prefilled as text (the recompute path); then, with the block on disk again, the path the
backend's own cost model takes (rates measured on this machine by then) and its time. The claim to check: the
chosen path is never slower than the text arm by more than noise, and a load wins where it should.

Each request's user has its prefix-cache pages dropped first (no reuse between arms); times are wall clock from
the stream's start to its first token (the block's resolution, a read from disk, included). Medians of --reps.
The JSON records the git sha and the load average at the start (benchmarks/common.env_info).

    python -m benchmarks.tiers.load_or_recompute --out benchmarks/results/cpu/load_or_recompute.json
    # smoke: --sizes 64 --reps 1
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import tempfile
import time

from benchmarks.common import env_info, median, print_table, write_outputs
from benchmarks.ttft.memos_grid import memories_for
from serving.backends.base import GenerationRequest, SamplingParams, TokenDelta
from serving.backends.transformers.backend import TransformersBackend, TransformersBackendConfig
from serving.backends.transformers.load_costs import LoadCosts

QUESTION = [{"role": "user", "content": "What did I talk about?"}]


async def first_token_s(backend, req) -> tuple[float, object]:
    started, first, result = time.perf_counter(), None, None
    async for item in backend.stream(req):
        if isinstance(item, TokenDelta) and first is None:
            first = time.perf_counter() - started
        elif not isinstance(item, TokenDelta):
            result = item
    return first if first is not None else time.perf_counter() - started, result


def to_disk(backend, item_id: str) -> None:
    """The block out of the pool and out of RAM: on disk only."""
    backend.pool.shared.drop(item_id)
    config = backend.store.config
    backend.store.config = dataclasses.replace(config, host_bytes=0)
    backend.store.get(item_id)  # over the budget of 0: it leaves RAM
    backend.store.config = config
    assert backend.store.tier_of(item_id) == "disk"


def run_size(backend, size: int, reps: int) -> dict:
    user = f"bench-{size}"
    texts = memories_for(backend.layout, size, seed=size)
    block = backend.build_block(user, texts, [f"m{i}" for i in range(len(texts))])
    prompt = backend.layout_prompt(texts, [], QUESTION, block.token_ids)

    def req(with_block: bool) -> GenerationRequest:
        return GenerationRequest(
            f"r-{user}",
            user,
            prompt,
            block.item_id if with_block else None,
            SamplingParams(max_new_tokens=1, temperature=0.0),
        )

    measured = backend.costs
    times: dict[str, list[float]] = {"pool": [], "host": [], "disk": [], "text": [], "auto": []}
    chosen = []
    for _ in range(reps):
        backend.costs = LoadCosts()  # no prefill rate: always load (the arms below measure each tier)
        backend.pool.prefix.drop_user(user)
        times["text"].append(asyncio.run(first_token_s(backend, req(False)))[0])
        to_disk(backend, block.item_id)
        backend.pool.prefix.drop_user(user)
        times["disk"].append(asyncio.run(first_token_s(backend, req(True)))[0])
        backend.pool.prefix.drop_user(user)
        times["pool"].append(asyncio.run(first_token_s(backend, req(True)))[0])
        backend.pool.shared.drop(block.item_id)
        backend.pool.prefix.drop_user(user)
        times["host"].append(asyncio.run(first_token_s(backend, req(True)))[0])
        backend.costs = measured  # the backend's own model, fed by the loads above
        to_disk(backend, block.item_id)
        backend.pool.prefix.drop_user(user)
        decision = backend.decide_block(block.item_id)
        took, result = asyncio.run(first_token_s(backend, req(True)))
        times["auto"].append(took)
        chosen.append({**decision.to_dict(), "fallback": result.kv_fallback_reason})
    return {
        "tokens": block.num_tokens,
        "bytes": block.num_bytes,
        **{f"{arm}_ttft_s": median(ts) for arm, ts in times.items()},
        "auto_decisions": chosen,
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="the default model when omitted")
    p.add_argument("--sizes", type=int, nargs="+", default=[500, 1500, 4000])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    env = env_info("cpu")  # the load average before this run's own work
    with tempfile.TemporaryDirectory() as data:
        backend = TransformersBackend(TransformersBackendConfig(model=args.model, data_dir=data))
        backend.load()
        try:
            rows = [run_size(backend, size, args.reps) for size in args.sizes]
            rates = backend.costs.snapshot()
        finally:
            asyncio.run(backend.aclose())
    arms = ("pool", "host", "disk", "text", "auto")
    print_table(
        ["tokens", *arms, "auto path"],
        [[r["tokens"], *(r[f"{a}_ttft_s"] for a in arms), r["auto_decisions"][-1]["path"]] for r in rows],
    )
    result = {"env": env, "args": vars(args), "rates": rates, "rows": rows}
    write_outputs(result, args.out)
    return result


if __name__ == "__main__":
    main()

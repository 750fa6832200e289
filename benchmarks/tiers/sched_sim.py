"""Trace-driven scheduler simulation (CPU only; token counts stand in for the model).

Zipf retrievals per user within a topic that drifts half-way; ours, LRU, LFU and a clairvoyant optimum at equal
KV capacity; KV-served share, requests until the new topic is resident, rebuilds and prefill, and the real
Scheduler's request-path overhead. "ours" is the server's own scheduler, not a model of it: the real
`Scheduler` (heat table, worker, policy) over a trace-backed store and block maker, an injected clock, and the
server's accounting of a turn (`scheduler.turn_access`). `--out F.json` (see benchmarks/README).
"""

from __future__ import annotations

import argparse
import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import NamedTuple

from benchmarks.common import env_info, median, print_table, write_outputs
from scheduler import BlockMaker, Scheduler, SchedulerConfig, turn_access

TOPICS = ("buying a home", "renovating", "work", "health", "travel")


@dataclass(frozen=True)
class UserTrace:
    sizes: dict[str, int]  # memory id -> tokens
    requests: list[tuple[str, ...]]  # retrieved memory ids per request
    shift_at: int


def zipf_pick(rng: random.Random, items: list[str], s: float) -> str:
    weights = [1.0 / (i + 1) ** s for i in range(len(items))]
    return rng.choices(items, weights)[0]


def make_trace(
    seed: int, *, num_requests: int, per_topic: int, k: int, zipf_s: float, p_topic: float
) -> UserTrace:
    rng = random.Random(seed)
    topics = {t: [f"{t}:{i}" for i in range(per_topic)] for t in TOPICS}
    for ids in topics.values():
        rng.shuffle(ids)
    sizes = {m: rng.randint(20, 120) for ids in topics.values() for m in ids}
    everything = sorted(sizes)
    rng.shuffle(everything)
    before, after = "buying a home", "renovating"
    shift_at = num_requests // 2
    requests = []
    for r in range(num_requests):
        pool = topics[before if r < shift_at else after]
        picked: list[str] = []
        while len(picked) < k:
            m = zipf_pick(rng, pool, zipf_s) if rng.random() < p_topic else zipf_pick(rng, everything, zipf_s)
            if m not in picked:
                picked.append(m)
        requests.append(tuple(picked))
    return UserTrace(sizes, requests, shift_at)


def _fill(order: list[str], sizes: dict[str, int], cap: int) -> tuple[str, ...]:
    chosen, used = [], 0
    for m in order:
        if used + sizes[m] <= cap:
            chosen.append(m)
            used += sizes[m]
    return tuple(chosen)


def _stable(chosen: tuple[str, ...], old: tuple[str, ...]) -> tuple[str, ...]:
    """The baselines' block order: members they keep stay first, in their old order (the most prefix reuse a
    set-based policy can get), then the new members."""
    members = set(chosen)
    kept = [m for m in old if m in members]
    return (*kept, *(m for m in chosen if m not in set(kept)))


@dataclass
class PolicyResult:
    policy: str
    served_share: float
    ratio_to_optimum: float
    shift_requests_p50: float
    rebuilds_per_user: float
    appends_per_user: float
    prefill_tokens_per_request: (
        float  # block tokens prefilled off the request path (all that follows the kept prefix)
    )


@dataclass(frozen=True)
class TraceMemory:
    """A trace memory as the scheduler reads one from the store: its text is its id (count_tokens maps it)."""

    id: str
    text: str
    version: int = 1
    created_at: float = 0.0


class TracePage(NamedTuple):
    items: list[TraceMemory]
    total: int


class TraceSource:
    """The scheduler's MemorySource over one trace's memories (one user, nothing ever changes)."""

    def __init__(self, sizes: dict[str, int]):
        self.memories = [TraceMemory(m, m) for m in sizes]

    def list(self, user_id: str, *, session_id: str | None = None, page: int = 1, page_size: int = 20):
        return TracePage(self.memories[(page - 1) * page_size : page * page_size], len(self.memories))

    def subscribe(self, callback):
        return lambda: None


class TraceBlockMaker(BlockMaker):
    """The scheduler's BlockMaker without a model: a block is its memories' token count; every build is kept
    in `builds`, so each block the scheduler made is counted, not only the last of a request."""

    def __init__(self, sizes: dict[str, int]):
        from kvmem.kv.blocks import BuiltBlock  # the type every block maker returns

        self.sizes, self._built_block = sizes, BuiltBlock
        self.builds: list[tuple[str, ...]] = []

    def ready(self) -> bool:
        return True

    def build_block(self, user_id: str, texts: Sequence[str], memory_ids: Sequence[str]):
        ids = tuple(memory_ids)
        self.builds.append(ids)
        n = sum(self.sizes[m] for m in ids)
        return self._built_block(f"block-{len(self.builds)}", ids, n, n, built=True)

    def drop_block(self, item_id: str) -> None:
        pass


def replay(policy: str, trace: UserTrace, cap: int, *, window: int, half_life_s: float, hysteresis: float):
    """Per request: (served tokens, retrieved tokens); plus rebuilds, appends and block tokens prefilled, counted
    the same way for every policy from how the block changed (a change that keeps the old block as a prefix
    is an append and prefills only the new tail; any other change prefills everything after the common
    prefix). "ours" serves each request from the plan the real Scheduler has published, then records the turn
    as the server does and runs the worker's tasks before the next request."""
    sizes, out = trace.sizes, []
    block: tuple[str, ...] = ()
    last: dict[str, int] = {}
    count: Counter[str] = Counter()
    rebuilds = appends = prefilled = 0
    now = 0.0
    maker = TraceBlockMaker(sizes)
    sched = Scheduler(
        SchedulerConfig(user_block_tokens=cap, half_life_s=half_life_s, hysteresis=hysteresis),
        TraceSource(sizes),
        maker,
        sizes.__getitem__,
        clock=lambda: now,
    )

    def change(new: tuple[str, ...]) -> tuple[str, ...]:
        nonlocal rebuilds, appends, prefilled
        if new != block:
            keep = next(
                (i for i, (a, b) in enumerate(zip(block, new, strict=False)) if a != b),
                min(len(block), len(new)),
            )
            prefilled += sum(sizes[m] for m in new[keep:])
            if keep == len(block):
                appends += 1
            else:
                rebuilds += 1
        return new

    for r, req in enumerate(trace.requests):
        now = 60.0 * (r + 1)
        if policy == "optimum" and r % window == 0:
            future = Counter(m for q in trace.requests[r : r + window] for m in q)
            block = change(_stable(_fill(sorted(future, key=lambda m: (-future[m], m)), sizes, cap), block))
        if policy == "ours":
            plan = sched.get("u")  # the request path's plan read
            assert (plan.block.memory_ids if plan.block else ()) == block
        members = set(block)
        total = sum(sizes[m] for m in req)
        out.append((sum(sizes[m] for m in req if m in members), total))
        # what the scheduler learns after the turn, applied before the next request
        for m in req:
            last[m] = r
            count[m] += 1
        if policy == "lru":
            block = change(_stable(_fill(sorted(last, key=lambda m: (-last[m], m)), sizes, cap), block))
        elif policy == "lfu":
            block = change(
                _stable(_fill(sorted(count, key=lambda m: (-count[m], -last[m], m)), sizes, cap), block)
            )
        elif policy == "ours":
            sched.record_access(turn_access("u", req, at=now))  # the server's accounting of a turn
            built = len(maker.builds)
            sched.run_pending()
            for ids in maker.builds[built:]:
                block = change(ids)
            published = sched.plans.get("u").block  # what the next request will read
            block = change(published.memory_ids if published else ())
    sched.stop()
    return out, rebuilds, appends, prefilled


def shift_latency(served: list[tuple[int, int]], shift_at: int, threshold: float = 0.8) -> int:
    """Requests after the topic shift until one is served >= threshold from KV (len(after) if never)."""
    after = served[shift_at:]
    return next((i for i, (s, t) in enumerate(after) if t and s / t >= threshold), len(after))


def request_path_overhead(iterations: int) -> dict:
    """p50/p99 of the real Scheduler's plan read + access event (enqueue), in microseconds."""
    sched = Scheduler(SchedulerConfig(), TraceSource({}), TraceBlockMaker({}), len)
    times = []
    for i in range(iterations):
        t0 = time.perf_counter()
        sched.get(f"user{i % 100}")
        sched.record_access(turn_access(f"user{i % 100}", ("a", "b"), at=0.0))
        times.append(time.perf_counter() - t0)
        if len(sched.queue) > 10_000:
            while sched.queue.get(timeout_s=0) is not None:
                pass
    times.sort()
    return {
        "iterations": iterations,
        "p50_us": 1e6 * times[len(times) // 2],
        "p99_us": 1e6 * times[int(0.99 * (len(times) - 1))],
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.tiers.sched_sim", description=__doc__.splitlines()[0]
    )
    p.add_argument("--quick", action="store_true")
    p.add_argument("--users", type=int, default=60)
    p.add_argument("--requests", type=int, default=240, help="requests per user")
    p.add_argument("--per-topic", type=int, default=16, help="memories per topic (5 topics)")
    p.add_argument("--k", type=int, default=4, help="memories retrieved per request")
    p.add_argument(
        "--cap-tokens", type=int, default=600, help="per-user KV capacity (equal for every policy)"
    )
    p.add_argument("--zipf", type=float, default=1.1)
    p.add_argument("--p-topic", type=float, default=0.85, help="share of retrievals from the active topic")
    p.add_argument(
        "--window",
        type=int,
        default=None,
        help="the optimum re-plans every `window` requests (default: once per topic phase)",
    )
    p.add_argument("--half-life-s", type=float, default=600.0, help="heat half-life; a request every 60 s")
    p.add_argument("--hysteresis", type=float, default=1.02)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.quick:
        args.users, args.requests = 8, 80
    traces = [
        make_trace(
            args.seed * 1000 + u,
            num_requests=args.requests,
            per_topic=args.per_topic,
            k=args.k,
            zipf_s=args.zipf,
            p_topic=args.p_topic,
        )
        for u in range(args.users)
    ]
    window = args.window or args.requests // 2
    results: dict[str, PolicyResult] = {}
    for policy in ("optimum", "ours", "lru", "lfu"):
        served = total = rebuilds = appends = prefilled = 0
        shifts = []
        for tr in traces:
            out, rb, ap, pf = replay(
                policy,
                tr,
                args.cap_tokens,
                window=window,
                half_life_s=args.half_life_s,
                hysteresis=args.hysteresis,
            )
            served += sum(s for s, _ in out)
            total += sum(t for _, t in out)
            rebuilds, appends, prefilled = rebuilds + rb, appends + ap, prefilled + pf
            shifts.append(shift_latency(out, tr.shift_at))
        results[policy] = PolicyResult(
            policy,
            served / total,
            0.0,
            median(shifts),
            rebuilds / len(traces),
            appends / len(traces),
            prefilled / (len(traces) * args.requests),
        )
    best = results["optimum"].served_share
    for r in results.values():
        r.ratio_to_optimum = r.served_share / best
    overhead = request_path_overhead(2_000 if args.quick else 20_000)
    print_table(
        [
            "Policy",
            "KV-served share",
            "vs optimum",
            "Shift -> resident (req)",
            "Rebuilds/user",
            "Appends/user",
            "Prefill tok/req",
        ],
        [
            [
                r.policy,
                round(r.served_share, 4),
                round(r.ratio_to_optimum, 4),
                r.shift_requests_p50,
                r.rebuilds_per_user,
                r.appends_per_user,
                round(r.prefill_tokens_per_request, 1),
            ]
            for r in results.values()
        ],
    )
    print(
        f"request path (plan read + access event): p50 {overhead['p50_us']:.1f} us, p99 {overhead['p99_us']:.1f} us"
    )
    result = {
        "env": env_info(),
        "config": {**{k: v for k, v in vars(args).items() if k != "out"}, "window": window},
        "policies": [asdict(r) for r in results.values()],
        "request_path": overhead,
    }
    write_outputs(result, args.out)
    return result


if __name__ == "__main__":
    main()

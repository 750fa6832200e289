"""The page pool's bookkeeping at a large pool's size (issue 42 item 9): alloc/release, evict and stats.

A GPU pool sized from free memory has 100k+ pages (an H200 after an 8B model: ~50k pages of 16 tokens; a
smaller model, far more). What each operation costs there, with no model and no forward: the pool's K/V
tensors are tiny (one layer, one head of 8 dims), so only the bookkeeping is timed.

- alloc/release: half the pages held, scattered (every other page: the free pages are singles and short
  runs, as after many requests came and went), then `--ops` times: take a prompt's pages (`--prompt-pages`),
  take one page (a decode crossing into a page), give them back;
- evict: `--entries` resident items (one page each, all unread), then one `evict` of all of them (a request
  that needs the whole pool);
- stats: `stats()` (each /metrics scrape) with those entries resident;
- alloc on a full pool: every page held by the prefix cache alone (unread, `--users` users' chains), then
  `--ops` times: take one page (evicting the least recently used cached page), cache it again under a new key
  and let go of it, so the next one finds the pool full again. Only the `alloc(1)` is timed: what a decode
  step pays for a page once the cache has filled the pool (0dd00e7 made its room check a bound that stops
  at what is missing; before it, a pass over the whole index per page).

Medians and p90 over the repeats, one table, the JSON (git sha, load average) to --out. The same script runs
at the commit before the change (b59d2de; the pool there is 879ab03's) for the "before" column. A smoke run
on the busy 2-core machine at 20k pages and 2,000 entries, ms median before -> after: alloc/release 0.84 ->
0.066, evict all 134 -> 8.5, stats 0.20 -> 0.004. The figure (a quiet machine):

    git worktree add /tmp/before b59d2de && cp benchmarks/engine/pool_ops.py /tmp/before/benchmarks/engine/
    (cd /tmp/before && python -m benchmarks.engine.pool_ops --pages 100000 --entries 20000 \
        --out benchmarks/results/cpu/pool_ops_before.json)
    python -m benchmarks.engine.pool_ops --pages 100000 --entries 20000 --out benchmarks/results/cpu/pool_ops.json

The full-pool row before and after 0dd00e7 (the script copied into a worktree of 72b7c42, as above):
`--pages 50000 --out benchmarks/results/cpu/pool_ops_full_72b7c42.json` there, and `--out
benchmarks/results/cpu/pool_ops_full_<sha>.json` here.
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.common import env_info, median, p90, print_table, write_outputs
from serving.engine.pages import PagePool, PoolShape
from serving.engine.prefix_cache import PrefixKey

SHAPE = PoolShape(layers=1, kv_heads=1, head_dim=8, dtype=torch.float32)


class PageItem:
    """What SharedPages.acquire reads of a stored item: its id, tokens and K/V (zeros), no parent."""

    parent = None
    own_start = 0

    def __init__(self, item_id: str, num_tokens: int) -> None:
        self.item_id, self.num_tokens = item_id, num_tokens

    def kv_range(self, start: int, end: int) -> torch.Tensor:
        return torch.zeros(SHAPE.layers, 2, SHAPE.kv_heads, end - start, SHAPE.head_dim)


def timings(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def alloc_release(pages: int, ops: int, prompt_pages: int) -> list[float]:
    pool = PagePool(SHAPE, pages * SHAPE.page_bytes)
    held = pool.alloc(pages)
    pool.release(held[::2])  # every other page free: singles

    def one() -> None:
        prompt = pool.alloc(prompt_pages)
        step = pool.alloc(1)
        pool.release(prompt + step)

    one()  # warm-up
    return timings(one, ops)


def resident(pages: int, entries: int) -> PagePool:
    pool = PagePool(SHAPE, pages * SHAPE.page_bytes)
    for i in range(entries):
        read = pool.shared.acquire(PageItem(f"item-{i}", SHAPE.page_tokens))
        pool.shared.release(read.entry)
    return pool


def evict_all(pages: int, entries: int, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        pool = resident(pages, entries)
        start = time.perf_counter()
        pool.shared.evict(entries)
        out.append(time.perf_counter() - start)
        assert pool.used_pages == 0
    return out


def stats(pages: int, entries: int, repeats: int) -> list[float]:
    pool = resident(pages, entries)
    pool.stats()
    return timings(pool.stats, repeats)


def alloc_full(pages: int, users: int, ops: int) -> list[float]:
    pool = PagePool(SHAPE, pages * SHAPE.page_bytes)
    keys = [PrefixKey(f"user-{u}") for u in range(users)]
    serial = iter(range(1 << 62))

    def cache(page: int) -> None:  # the page under a fresh key of a user's, then the cache's alone
        pool.prefix.insert(keys[page % users], [next(serial).to_bytes(32, "big")], [page], 0)
        pool.release([page])

    for page in pool.alloc(pages):
        cache(page)
    assert pool.free_pages == 0 and len(pool.prefix) == pages
    out = []
    for _ in range(ops + 1):  # the first is a warm-up
        start = time.perf_counter()
        (page,) = pool.alloc(1)
        out.append(time.perf_counter() - start)
        cache(page)
    assert pool.free_pages == 0 and len(pool.prefix) == pages
    return out[1:]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pages", type=int, default=100_000)
    p.add_argument("--entries", type=int, default=20_000, help="resident items for evict and stats")
    p.add_argument("--ops", type=int, default=200, help="alloc/release rounds")
    p.add_argument("--prompt-pages", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5, help="evict and stats repeats")
    p.add_argument("--users", type=int, default=100, help="users whose cached pages fill the pool")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.entries > args.pages:
        p.error(f"--entries ({args.entries}) must be <= --pages ({args.pages})")
    rows = {
        "alloc_release": alloc_release(args.pages, args.ops, args.prompt_pages),
        "evict_all": evict_all(args.pages, args.entries, args.repeats),
        "stats": stats(args.pages, args.entries, max(args.repeats, 20)),
        "alloc_full": alloc_full(args.pages, args.users, args.ops),
    }
    result = {
        "env": env_info("cpu"),
        "pages": args.pages,
        "entries": args.entries,
        "prompt_pages": args.prompt_pages,
        "users": args.users,
        "ops_ms": {k: {"median": median(v) * 1e3, "p90": p90(v) * 1e3, "n": len(v)} for k, v in rows.items()},
    }
    print_table(
        ["op", "median ms", "p90 ms", "n"],
        [[k, v["median"], v["p90"], v["n"]] for k, v in result["ops_ms"].items()],
    )
    write_outputs(result, args.out)
    return result


if __name__ == "__main__":
    main()

"""A long block build while another user's reply streams: how long the stream's worst gap between two tokens
is against its median, with the engine (a build is a chunked prefill in the steps every stream runs). The
path before the engine (a build as one unchunked prefill on the model thread) is no longer in the server; its
last measurement is the `old` arm of benchmarks/results/cpu/build_stall.json.

Through the production backend (TransformersBackend, the real default model): a greedy stream of --tokens
tokens starts; once it has --build-after tokens, a thread calls `build_block` for memories of ~--block-tokens
tokens; every token's arrival time is recorded. Reports the gaps' median, max, and max/median, the
max against the median of the gaps outside the build (the stream's own pace: with small build chunks most of
a short stream's gaps fall inside the build), the 5 longest gaps, and the build's wall time. The issue's
target: max <= 3x median with the engine (the old path ~9x). The stream should outlast the build
(`build_ended_before_stream` in the JSON): a build running alone takes full prefill chunks. The heap is
frozen once the model is loaded, as `kvmem serve` does (serving/background/startup.py `freeze_heap`).
Last line of stdout: the JSON written to --out.

    python -m benchmarks.engine.build_stall --out benchmarks/results/cpu/build_stall.json
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import threading
import time

from benchmarks.common import OthersCpu, env_info, median, print_table, write_outputs
from benchmarks.ttft.memos_grid import memories_for
from serving.backends.base import GenerationRequest, SamplingParams, TokenDelta
from serving.backends.transformers.backend import TransformersBackend, TransformersBackendConfig
from serving.background.startup import freeze_heap


def run_arm(args, pool_mb: int) -> dict:
    with tempfile.TemporaryDirectory() as data:
        backend = TransformersBackend(
            TransformersBackendConfig(
                model=args.model,
                data_dir=data,
                kv_pool_mb=pool_mb,
                device="cpu",
                **{
                    k: v
                    for k, v in (
                        ("build_chunk_tokens", args.build_chunk_tokens),
                        ("build_attention_budget", args.build_attention_budget),
                    )
                    if v is not None
                },
            )
        )
        backend.load()
        freeze_heap()  # as `kvmem serve` does once the model is loaded (serving/background/startup.py)
        try:
            texts = memories_for(backend.layout, args.block_tokens, seed=3)
            prompt = backend.layout_prompt([], [], [{"role": "user", "content": "Tell me a long story."}])
            sampling = SamplingParams(max_new_tokens=args.tokens, temperature=0.0)
            req = GenerationRequest("stream", "reader", prompt, None, sampling)
            stamps: list[float] = []
            build: dict = {}

            store_item = backend.builder.store_item

            def timed_store_item(item):  # the build's write phase (file, fsync, SHA-256 on an I/O thread)
                build["write_start"] = time.perf_counter()
                try:
                    return store_item(item)
                finally:
                    build["write_end"] = time.perf_counter()

            backend.builder.store_item = timed_store_item

            def do_build():
                t = time.perf_counter()
                built = backend.build_block("builder", texts, [f"m{i}" for i in range(len(texts))])
                build.update(start=t, end=time.perf_counter(), tokens=built.num_tokens)

            async def consume():
                worker = None
                async for item in backend.stream(req):
                    if isinstance(item, TokenDelta):
                        stamps.extend([time.perf_counter()] * len(item.token_ids))
                        if worker is None and len(stamps) >= args.build_after:
                            worker = threading.Thread(target=do_build)
                            worker.start()
                if worker is not None:
                    await asyncio.to_thread(worker.join)

            asyncio.run(consume())
        finally:
            asyncio.run(backend.aclose())
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    during = [
        b - a for a, b in zip(stamps, stamps[1:], strict=False) if a < build["end"] and b > build["start"]
    ]
    med = median(gaps)
    outside = [
        b - a for a, b in zip(stamps, stamps[1:], strict=False) if b <= build["start"] or a >= build["end"]
    ]
    largest = sorted(range(len(gaps)), key=gaps.__getitem__, reverse=True)[:5]
    return {
        "kv_pool_mb": pool_mb,
        "build_chunk_tokens": backend.config.build_chunk_tokens,
        "build_attention_budget": backend.config.build_attention_budget,
        "tokens": len(stamps),
        "block_tokens": build["tokens"],
        "build_s": build["end"] - build["start"],
        "gap_median_s": med,
        "gap_max_s": max(gaps),
        "max_over_median": max(gaps) / med,
        "gaps_during_build": len(during),
        # against the stream's own pace when no build runs (its gaps before and after the build)
        "gap_median_outside_build_s": median(outside) if outside else None,
        "max_over_median_outside_build": max(gaps) / median(outside) if outside else None,
        # the 5 longest gaps: their length and where they began, in seconds from the build's start
        "largest_gaps": [
            {
                "gap_s": gaps[i],
                "from_build_start_s": stamps[i] - build["start"],
                "phase": _phase(build, stamps[i], stamps[i + 1]),
            }
            for i in largest
        ],
        "write_s": build["write_end"] - build["write_start"],
        "write_from_build_start_s": build["write_start"] - build["start"],
        "build_ended_before_stream": build["end"] <= stamps[-1],
    }


def _phase(build: dict, a: float, b: float) -> str:
    """Where the gap [a, b] fell: before the build, its model part, its write (overlapping), or after it."""
    if b <= build["start"]:
        return "before"
    if a >= build["end"]:
        return "after"
    if b > build["write_start"] and a < build["write_end"]:
        return "write"
    return "model"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.engine.build_stall", description=__doc__.splitlines()[0]
    )
    p.add_argument("--model", default=None)
    p.add_argument("--block-tokens", type=int, default=4000)
    p.add_argument("--tokens", type=int, default=600, help="tokens the stream generates")
    p.add_argument("--build-after", type=int, default=10, help="stream tokens before the build starts")
    p.add_argument("--pool-mb", type=int, default=1024)
    p.add_argument(
        "--build-chunk-tokens",
        type=int,
        default=None,
        help="the engine's build chunk (default: the backend's)",
    )
    p.add_argument(
        "--build-attention-budget",
        type=int,
        default=None,
        help="the engine's cap on a build chunk's tokens x context while streams decode (default: the "
        "backend's; a large value turns it off)",
    )
    p.add_argument(
        "--arms",
        nargs="+",
        choices=["engine"],
        default=["engine"],
        help="engine only (the old arm went with the path it measured; kept for the commands written before)",
    )
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    arms = {}
    meter = OthersCpu()  # other processes' share of the cores (steal included): a clean run has ~0
    meter.start()
    arms["engine"] = run_arm(args, args.pool_mb)
    arms["engine"]["others_cpu_share"] = meter.share()
    print_table(
        [
            "arm",
            "build s",
            "gap median s",
            "gap max s",
            "max/median",
            "max/median outside",
            "build within stream",
            "others' CPU",
        ],
        [
            [
                a,
                r["build_s"],
                r["gap_median_s"],
                r["gap_max_s"],
                r["max_over_median"],
                r["max_over_median_outside_build"],
                r["build_ended_before_stream"],
                r["others_cpu_share"],
            ]
            for a, r in arms.items()
        ],
    )
    result = {"env": env_info("cpu"), "args": vars(args), "arms": arms}
    write_outputs(result, args.out)
    return result


if __name__ == "__main__":
    main()

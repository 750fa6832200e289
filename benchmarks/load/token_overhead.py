"""Per-token server overhead: the gap between streamed tokens over HTTP minus the in-process decode step.

One `kvmem serve` (transformers backend, default model, no memories, one client at a time) streams a greedy
reply through the real path (chat route, model thread, detokenization, SSE over loopback HTTP); the gaps
between consecutive content chunks at the client are per-token times. The same prompt ids (the backend's own
layout of the same messages) go through `kvmem.kv.generate` in this process, timing each decode step. Runs
alternate (HTTP, in-process, HTTP, ...) so both arms see the same machine load; the replies must be the same
text (else the run is refused: it would not be the same ids). The overhead is p50(HTTP gap) - p50(step),
per rep and over all tokens.

    python -m benchmarks.load.token_overhead --reps 5 --max-tokens 64 --out benchmarks/results/cpu/token_overhead.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from benchmarks.common import OthersCpu, env_info, median, p90, print_table, write_outputs
from benchmarks.load.http_client import _get, spawned_server

QUESTION = "Tell me a short story about a lighthouse keeper and a cat."


def http_gaps(base: str, model: str, max_tokens: int) -> tuple[list[float], str, int, int]:
    """(gaps between consecutive content chunks, the reply's text, content chunks, completion tokens)."""
    import httpx

    body = {
        "model": model,
        "user": "bench",
        "temperature": 0,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": QUESTION}],
    }
    times, text, tokens = [], [], 0
    with httpx.Client(timeout=600) as client:
        with client.stream("POST", f"{base}/v1/chat/completions", json=body) as resp:
            resp.raise_for_status()
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                chunk = json.loads(line[len("data: ") :])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", []):
                    content = choice.get("delta", {}).get("content")
                    if content:
                        times.append(now)
                        text.append(content)
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    return gaps, "".join(text), len(times), tokens


def in_process_steps(backend, max_tokens: int) -> tuple[list[float], str]:
    """(seconds of each decode step after the first token, the reply's text), greedy, on this process's model."""
    from kvmem.kv import Sampling, generate

    prompt = backend.layout_prompt((), [], [{"role": "user", "content": QUESTION}], None)
    ids, stamps = [], []
    for token in generate(
        backend.handle.model,
        prompt.ids,
        sampling=Sampling(max_new_tokens=max_tokens, temperature=0.0),
        stop_token_ids=backend._eos,
    ):
        stamps.append(time.perf_counter())
        if token in backend._eos:
            break
        ids.append(token)
    steps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return steps, backend.handle.tokenizer.decode(ids, skip_special_tokens=True)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.load.token_overhead", description=__doc__.splitlines()[0]
    )
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--model", default=None, help="default: the embedded default model")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    from serving.backends.transformers.backend import TransformersBackend, TransformersBackendConfig

    tmp = tempfile.mkdtemp(prefix="kvmem-token-overhead-")
    backend = TransformersBackend(
        TransformersBackendConfig(model=args.model, device="cpu", dtype="float32", data_dir=f"{tmp}/inproc")
    )
    backend.load()
    env = env_info("cpu")
    others = OthersCpu()
    reps = []
    with spawned_server(
        backend="transformers", model=args.model, block_budget=0, top_k=1, data_dir=f"{tmp}/server"
    ) as base:
        model = _get(f"{base}/v1/models")["data"][0]["id"]
        http_gaps(base, model, 4)  # warm-up: first forward, allocator, connection handling
        in_process_steps(backend, 4)
        others.start()
        for rep in range(args.reps):
            gaps, http_text, chunks, tokens = http_gaps(base, model, args.max_tokens)
            steps, text = in_process_steps(backend, args.max_tokens)
            if http_text != text:
                raise RuntimeError(f"rep {rep}: the server's reply differs from the in-process one")
            reps.append(
                {
                    "http_gap_p50_s": median(gaps),
                    "step_p50_s": median(steps),
                    "overhead_p50_s": median(gaps) - median(steps),
                    "chunks": chunks,
                    "completion_tokens": tokens,
                    "http_gaps_s": gaps,
                    "steps_s": steps,
                    "loadavg": list(os.getloadavg()),
                }
            )
        share = others.share()
    all_gaps = [g for r in reps for g in r["http_gaps_s"]]
    all_steps = [s for r in reps for s in r["steps_s"]]
    result = {
        "benchmark": "token_overhead",
        "env": env,
        "args": vars(args),
        "question": QUESTION,
        "others_cpu_share": share,
        "loadavg_end": list(os.getloadavg()),
        "http_gap_p50_s": median(all_gaps),
        "http_gap_p90_s": p90(all_gaps),
        "step_p50_s": median(all_steps),
        "step_p90_s": p90(all_steps),
        "overhead_p50_s": median(all_gaps) - median(all_steps),
        "overhead_p50_of_reps_s": median([r["overhead_p50_s"] for r in reps]),
        "reps": reps,
    }
    print_table(
        ["rep", "http gap p50 ms", "step p50 ms", "overhead ms", "chunks", "tokens"],
        [
            [
                i,
                1e3 * r["http_gap_p50_s"],
                1e3 * r["step_p50_s"],
                1e3 * r["overhead_p50_s"],
                r["chunks"],
                r["completion_tokens"],
            ]
            for i, r in enumerate(reps)
        ],
    )
    print(
        f"# all tokens: http gap p50 {1e3 * result['http_gap_p50_s']:.2f} ms, step p50 "
        f"{1e3 * result['step_p50_s']:.2f} ms, overhead p50 {1e3 * result['overhead_p50_s']:.2f} ms; "
        f"others' CPU share {share}, load {result['loadavg_end']}",
        file=sys.stderr,
    )
    write_outputs(result, args.out)
    return result


if __name__ == "__main__":
    main()

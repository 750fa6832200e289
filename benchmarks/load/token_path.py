"""Where a streamed token's time goes, from the model thread producing it to the client reading it.

The real server (the app `kvmem serve` builds, transformers backend, the default model unless --model) runs in
this process on uvicorn in a thread, with probes around its pieces; the clients run in a child process (one
asyncio loop, raw HTTP/1.1 over loopback, greedy streaming chat requests), so they never take this process's
GIL. Both processes stamp with time.perf_counter (CLOCK_MONOTONIC on Linux: one clock for both). Per level
(1, 8, 32 clients by default), per token:

- `step`: one engine forward on the model thread (runner.step), and the rows in it;
- `deliver`: the rest of the batcher's step (tokens handed to the requests: detokenization, stop strings, the
  hand-off to the event loop), the model thread's own work outside the forward;
- `gap`: from the end of one batcher step to the start of the next, with the model thread's CPU time in it
  (busy with other work, or waiting: for work, for the GIL);
- `produced_to_written`: from the end of the forward that produced a token to the moment its SSE bytes were
  handed to the socket (the server's outermost ASGI send returned), split at the model thread's hand-off
  (`produced_to_emitted`, `emitted_to_written`);
- `client_gap`: the gaps between a stream's content events as the client reads them;
- counts: SSE events and HTTP body writes per content token, event-loop hops (call_soon_threadsafe) per
  token, and the CPU seconds per token of the model thread and of the event-loop thread.

    python -m benchmarks.load.token_path --levels 1 8 32 --max-tokens 64 --requests 2 \\
        --out benchmarks/results/cpu/token_path.json

On a GPU (the same script, the server on the card): add `--device cuda --dtype bfloat16`. With `--count-calls`
it counts the function calls per token on the model thread and on the event loop (counts a busy machine does
not change; that run's timings are not to be read).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from bisect import bisect_right
from collections import defaultdict

from benchmarks.common import env_info, median, p90, print_table, write_outputs
from benchmarks.load.stream_clients import EVENT, QUESTION


# -- probes in the server process ----------------------------------------------------------------------------
def _thread_cpu_s(thread: threading.Thread) -> float:
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


class CallCounter:
    """Python and C function calls made on one thread (sys.setprofile in that thread): a count of the work per
    token that a busy machine does not change (the timings of a run that counts are not to be read)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, frame, event, arg) -> None:
        if event == "call" or event == "c_call":
            self.calls += 1

    def install(self) -> None:
        """In the thread to count."""
        sys.setprofile(self)


class Probes:
    """Stamps around the server's pieces (class attributes wrapped in this process only; `remove` undoes it)."""

    def __init__(self) -> None:
        self.steps: list[tuple[float, float, int]] = []  # (start, end, rows) of each forward
        self.batcher: list[tuple[float, float, float, float]] = []  # (start, end, cpu start, cpu end)
        self.emits: dict[str, list[tuple[float, str]]] = defaultdict(list)  # request id -> (time, kind)
        self.writes: list[list] = []  # per response: [(time, body bytes), ...]
        self.hops = 0
        self.per_emit_hop = False
        self._undo: list = []

    def reset(self) -> None:
        self.steps.clear()
        self.batcher.clear()
        self.emits.clear()
        self.writes.clear()
        self.hops = 0

    def _patch(self, owner, name: str, new) -> None:
        self._undo.append((owner, name, owner.__dict__[name]))
        setattr(owner, name, new)

    def install(self) -> None:
        from serving.backends.transformers.steps import EngineRequests
        from serving.engine import runner
        from serving.engine.batcher import Batcher

        probes = self
        step, bstep, steps_fn = runner.step, Batcher.step, EngineRequests._steps

        def timed_step(model, pool, prefills, decodes):
            t0 = time.perf_counter()
            out = step(model, pool, prefills, decodes)
            probes.steps.append((t0, time.perf_counter(), len(prefills) + len(decodes)))
            return out

        def timed_batcher_step(self):
            c0, t0 = time.thread_time(), time.perf_counter()
            bstep(self)
            probes.batcher.append((t0, time.perf_counter(), c0, time.thread_time()))

        def traced_steps(self, req, emit, *args, **kwargs):
            rid = req.request_id

            def traced_emit(obj):
                probes.emits[rid].append((time.perf_counter(), type(obj).__name__))
                probes.hops += probes.per_emit_hop
                emit(obj)

            return steps_fn(self, req, traced_emit, *args, **kwargs)

        self._patch(runner, "step", timed_step)
        self._patch(Batcher, "step", timed_batcher_step)
        self._patch(EngineRequests, "_steps", traced_steps)
        try:  # event-loop hops: one per batch of items handed over (serving/engine/handoff.py)
            from serving.engine.handoff import Handoff
        except ImportError:  # before it: one call_soon_threadsafe per item emitted
            self.per_emit_hop = True
        else:
            flush = Handoff.flush

            def counted_flush(self):
                probes.hops += len(self._pending)  # one call_soon_threadsafe per event loop with items
                flush(self)

            self._patch(Handoff, "flush", counted_flush)

    def wrap(self, app):
        """The outermost ASGI layer: stamps every response body write once the server's send returned."""
        probes = self

        async def traced(scope, receive, send):
            if scope["type"] != "http" or scope.get("path") != "/v1/chat/completions":
                await app(scope, receive, send)
                return
            writes: list = []
            probes.writes.append(writes)

            async def stamped(message):
                await send(message)
                if message["type"] == "http.response.body":
                    writes.append((time.perf_counter(), message.get("body", b"")))

            await app(scope, receive, stamped)

        return traced

    def remove(self) -> None:
        for owner, name, old in reversed(self._undo):
            setattr(owner, name, old)
        self._undo.clear()


# -- the analysis ------------------------------------------------------------------------------------------
def _content_writes(writes: list) -> tuple[str | None, list[float], int, int]:
    """(the response's completion id, the write time of each content event, SSE events, body writes)."""
    rid, times, events, nonempty = None, [], 0, 0
    for t, body in writes:
        if body:
            nonempty += 1
        for m in EVENT.finditer(body):
            events += 1
            if m.group(1) == b"[DONE]":
                continue
            chunk = json.loads(m.group(1))
            rid = rid or chunk.get("id")
            for choice in chunk.get("choices", []):
                if choice.get("delta", {}).get("content"):
                    times.append(t)
    return rid, times, events, nonempty


def _stats(xs: list[float]) -> dict:
    return {"n": len(xs), "p50_ms": 1e3 * median(xs) if xs else None, "p90_ms": 1e3 * p90(xs) if xs else None}


def analyse(probes: Probes, streams: list[dict], wall_s: float, cpu: dict) -> dict:
    steps = sorted(probes.steps)
    ends = [e for _, e, _ in steps]
    batcher = sorted(probes.batcher)
    step_rows = [r for _, _, r in steps]
    deliver = []
    i = 0
    for b0, b1, _, _ in batcher:  # the batcher step minus the forwards inside it
        inner = 0.0
        while i < len(steps) and steps[i][0] < b1:
            if steps[i][0] >= b0:
                inner += steps[i][1] - steps[i][0]
            i += 1
        deliver.append(b1 - b0 - inner)
    gaps = [b[0] - a[1] for a, b in zip(batcher, batcher[1:], strict=False)]
    gap_cpu = [b[2] - a[3] for a, b in zip(batcher, batcher[1:], strict=False)]
    produced_emit, emit_written, produced_written = [], [], []
    events = writes = content = 0
    for response in probes.writes:
        rid, times, n_events, n_writes = _content_writes(response)
        events, writes, content = events + n_events, writes + n_writes, content + len(times)
        emitted = [t for t, kind in probes.emits.get(rid, []) if kind == "TokenDelta"]
        for t_write, t_emit in zip(times, emitted, strict=False):  # one content event per text delta
            k = bisect_right(ends, t_emit) - 1
            if k < 0:
                continue
            produced_emit.append(t_emit - ends[k])
            emit_written.append(t_write - t_emit)
            produced_written.append(t_write - ends[k])
    client_gaps = [b - a for s in streams for a, b in zip(s["times"], s["times"][1:], strict=False)]
    tokens = sum((s["usage"] or {}).get("completion_tokens", 0) for s in streams)
    return {
        "completion_tokens": tokens,
        "tokens_per_s": tokens / wall_s if wall_s else None,
        "wall_s": wall_s,
        "steps": len(steps),
        "rows_per_step_mean": sum(step_rows) / len(step_rows) if step_rows else None,
        "step": _stats([e - s for s, e, _ in steps]),
        "deliver": _stats(deliver),
        "gap": _stats(gaps),
        "gap_cpu": _stats(gap_cpu),
        "gap_total_s": sum(gaps),
        "gap_cpu_total_s": sum(gap_cpu),
        "step_total_s": sum(e - s for s, e, _ in steps),
        "deliver_total_s": sum(deliver),
        "produced_to_emitted": _stats(produced_emit),
        "emitted_to_written": _stats(emit_written),
        "produced_to_written": _stats(produced_written),
        "client_gap": _stats(client_gaps),
        "counts": {
            "content_events": content,
            "sse_events_per_content_token": events / content if content else None,
            "body_writes_per_content_token": writes / content if content else None,
            "loop_hops_per_content_token": probes.hops / content if content else None,
            "client_reads_per_content_token": sum(s["reads"] for s in streams) / content if content else None,
            "model_thread_cpu_ms_per_token": 1e3 * cpu["model"] / tokens if tokens else None,
            "event_loop_cpu_ms_per_token": 1e3 * cpu["loop"] / tokens if tokens else None,
        },
    }


# -- the driver ----------------------------------------------------------------------------------------------
def _server_config(args, data_dir: str):
    from serving.ops.cli import build_parser, config_from_args

    flags = ["serve", "--no-auth", "--host", "127.0.0.1", "--port", "0", "--data-dir", data_dir]
    flags += ["--block-token-budget", "0", "--retrieve-top-k", "1", "--no-store-turns"]
    flags += [
        "--queue-size",
        str(max(16, 2 * max(args.levels))),
        "--device",
        args.device,
        "--dtype",
        args.dtype,
    ]
    if args.model:
        flags += ["--model", args.model]
    return config_from_args(build_parser().parse_args(flags))


def _run_clients(base: str, model: str, clients: int, requests: int, max_tokens: int) -> list[dict]:
    cmd = [sys.executable, "-m", "benchmarks.load.stream_clients", "--base", base, "--model", model]
    cmd += ["--clients", str(clients), "--requests", str(requests), "--max-tokens", str(max_tokens)]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(x for x in (root, os.environ.get("PYTHONPATH")) if x)}
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=root, env=env, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"the client process failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout)


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.load.token_path", description=__doc__.splitlines()[0]
    )
    p.add_argument("--levels", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--requests", type=int, default=2, help="streams each client runs, one after another")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--model", default=None, help="default: the embedded default model")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument(
        "--count-calls",
        action="store_true",
        help="count the function calls per token on the model thread and the event loop (slows both: a run "
        "that counts is for the counts, not the timings)",
    )
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if min(args.levels) < 1 or args.requests < 1 or args.max_tokens < 2:
        p.error("--levels and --requests must be >= 1, --max-tokens >= 2")

    import uvicorn

    from serving.http.app import create_app
    from serving.http.server import uvicorn_config

    env = env_info(args.device)  # load average taken here, before the server starts
    tmp = tempfile.mkdtemp(prefix="kvmem-token-path-")
    probes = Probes()
    probes.install()
    app = create_app(_server_config(args, tmp))
    config = uvicorn_config(probes.wrap(app), 30.0, host="127.0.0.1", port=0, log_level="warning")
    server = uvicorn.Server(config)
    loop_calls, model_calls = CallCounter(), CallCounter()

    def serve() -> None:
        if args.count_calls:
            loop_calls.install()
        server.run()

    thread = threading.Thread(target=serve, name="uvicorn", daemon=True)
    thread.start()
    levels = []
    try:
        deadline = time.monotonic() + 300
        while not (server.started and app.state.backend.is_ready()):
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.1)
        port = server.servers[0].sockets[0].getsockname()[1]
        base = f"http://127.0.0.1:{port}"
        model = app.state.backend.model_id
        model_thread = app.state.backend._loop.thread
        if args.count_calls:
            app.state.backend._loop.call(model_calls.install)
        _run_clients(base, model, 1, 1, 4)  # warm-up: first forward, allocator, connection handling
        reference = None
        for clients in args.levels:
            probes.reset()
            cpu0 = (_thread_cpu_s(model_thread), _thread_cpu_s(thread))
            calls0 = (model_calls.calls, loop_calls.calls)
            t0 = time.perf_counter()
            streams = _run_clients(base, model, clients, args.requests, args.max_tokens)
            wall = time.perf_counter() - t0
            cpu = {"model": _thread_cpu_s(model_thread) - cpu0[0], "loop": _thread_cpu_s(thread) - cpu0[1]}
            texts = {"".join(s["texts"]) for s in streams}
            reference = reference or texts
            if len(texts) != 1 or texts != reference:
                raise RuntimeError(f"{clients} clients: the greedy replies differ between streams")
            level = {
                "clients": clients,
                **analyse(probes, streams, wall, cpu),
                "loadavg": list(os.getloadavg()),
            }
            if args.count_calls:
                tokens = level["completion_tokens"]
                level["counts"]["model_thread_calls_per_token"] = (model_calls.calls - calls0[0]) / tokens
                level["counts"]["event_loop_calls_per_token"] = (loop_calls.calls - calls0[1]) / tokens
            levels.append(level)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        probes.remove()
    result = {
        "benchmark": "token_path",
        "env": env,
        "args": vars(args),
        "question": QUESTION,
        "loadavg_end": list(os.getloadavg()),
        "levels": levels,
    }
    if args.count_calls:
        print_table(
            ["clients", "model thread calls/tok", "event loop calls/tok", "hops/tok", "writes/tok"],
            [
                [
                    lv["clients"],
                    lv["counts"]["model_thread_calls_per_token"],
                    lv["counts"]["event_loop_calls_per_token"],
                    lv["counts"]["loop_hops_per_content_token"],
                    lv["counts"]["body_writes_per_content_token"],
                ]
                for lv in levels
            ],
        )
    print_table(
        [
            "clients",
            "tok/s",
            "rows",
            "step ms",
            "deliver ms",
            "gap ms",
            "gap cpu ms",
            "made->sent ms",
            "emit->sent ms",
            "client gap ms",
            "writes/tok",
            "hops/tok",
            "loop cpu ms/tok",
        ],
        [
            [
                lv["clients"],
                lv["tokens_per_s"],
                lv["rows_per_step_mean"],
                lv["step"]["p50_ms"],
                lv["deliver"]["p50_ms"],
                lv["gap"]["p50_ms"],
                lv["gap_cpu"]["p50_ms"],
                lv["produced_to_written"]["p50_ms"],
                lv["emitted_to_written"]["p50_ms"],
                lv["client_gap"]["p50_ms"],
                lv["counts"]["body_writes_per_content_token"],
                lv["counts"]["loop_hops_per_content_token"],
                lv["counts"]["event_loop_cpu_ms_per_token"],
            ]
            for lv in levels
        ],
    )
    write_outputs(result, args.out)
    return result


if __name__ == "__main__":
    main()

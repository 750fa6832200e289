"""The per-token pieces of the event loop's side of a stream, before and after issue 43 item 4, alone: Python
calls per operation (sys.setprofile; a count a busy machine does not change) and microseconds per operation.

- `wait_for(queue.get)`: how a stream took each item before (asyncio.wait_for makes a task per call), against
  `Inbox.take` (serving/engine/handoff.py), an item being there;
- `is_disconnected`: Starlette's Request.is_disconnected, asked after every token before, every 0.25 s now;
- `event(chunk_dict)`: a content chunk's SSE line from the whole chunk dict, against the per-stream template
  (`serving/chat/sse.py` `content_event`), the same bytes;
- `detok.add`: the engine's incremental detokenizer (serving/engine/detok.py) on the default model's tokenizer,
  per token of a 74-token reply with multi-byte characters (flush included), on the model thread.

    python -m benchmarks.load.token_path_micro --out benchmarks/results/cpu/token_path_micro.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

from benchmarks.common import env_info, print_table, write_outputs


class _Calls:
    def __init__(self) -> None:
        self.n = 0

    def __call__(self, frame, event, arg) -> None:
        if event == "call" or event == "c_call":
            self.n += 1


async def _wait_for_get(reps: int) -> None:
    queue: asyncio.Queue = asyncio.Queue()
    for _ in range(reps):
        queue.put_nowait(1)
        await asyncio.wait_for(queue.get(), timeout=0.25)


async def _inbox_take(reps: int) -> None:
    from serving.engine.handoff import Inbox

    inbox = Inbox(asyncio.get_running_loop())
    for _ in range(reps):
        inbox._push(1)
        await inbox.take(0.25)


async def _is_disconnected(reps: int) -> None:
    from starlette.requests import Request

    async def receive():  # a client still there: nothing to receive
        await asyncio.sleep(3600)

    scope = {"type": "http", "method": "POST", "path": "/", "headers": [], "query_string": b""}
    request = Request(scope, receive)
    for _ in range(reps):
        await request.is_disconnected()


def _events():
    from serving.chat.sse import content_event as _content_event
    from serving.http.protocol import chunk_dict

    def event(delta, **kw):
        chunk = chunk_dict(
            completion_id="chatcmpl-0123456789abcdef",
            created=1764300000,
            model="SmolLM2-135M-Instruct",
            delta=delta,
            with_usage_field=True,
            **kw,
        )
        return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"

    content = _content_event(event)
    assert content(" the") == event({"content": " the"})

    def full(reps: int) -> None:
        for _ in range(reps):
            event({"content": " the"})

    def template(reps: int) -> None:
        for _ in range(reps):
            content(" the")

    return full, template


def _detok():
    from transformers import AutoTokenizer

    from kvmem.models import provision
    from serving.engine.detok import IncrementalDetokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(provision()))
    text = (
        "Sure! Here is a plan for your weekend in Lisbon: visit the bees, cook a sourdough. 日本語 😀 done."
    )
    ids = tokenizer.encode(text) * 2

    def add(reps: int) -> None:
        done = 0
        while done < reps:
            d = IncrementalDetokenizer(tokenizer)
            for i in ids[: reps - done]:
                d.add(i)
            d.flush()
            done += min(len(ids), reps - done)

    return add


def _measure(fn, reps: int) -> dict:
    calls = _Calls()
    sys.setprofile(calls)
    fn(min(reps, 1000))
    sys.setprofile(None)
    t = time.perf_counter()
    fn(reps)
    return {"calls_per_op": calls.n / min(reps, 1000), "us_per_op": 1e6 * (time.perf_counter() - t) / reps}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.load.token_path_micro", description=__doc__.splitlines()[0]
    )
    p.add_argument("--reps", type=int, default=20000)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    env = env_info("cpu")  # load average taken here, at the start
    full, template = _events()
    arms = {
        "wait_for(queue.get)": lambda n: asyncio.run(_wait_for_get(n)),
        "Inbox.take": lambda n: asyncio.run(_inbox_take(n)),
        "is_disconnected": lambda n: asyncio.run(_is_disconnected(n)),
        "event(chunk_dict)": full,
        "content_event": template,
        "detok.add": _detok(),
    }
    ops = {name: _measure(fn, args.reps) for name, fn in arms.items()}
    print_table(
        ["operation", "calls/op", "us/op"], [[k, v["calls_per_op"], v["us_per_op"]] for k, v in ops.items()]
    )
    result = {"benchmark": "token_path_micro", "env": env, "args": vars(args), "ops": ops}
    write_outputs(result, args.out)
    return result


if __name__ == "__main__":
    main()

"""The client side of benchmarks/load/token_path.py, run as its child process: concurrent greedy streaming chat
requests over raw HTTP/1.1 on loopback (one asyncio loop, no HTTP library in the way), the arrival time
(time.perf_counter) and text of every content event; JSON on stdout.

    python -m benchmarks.load.stream_clients --base URL --model ID --clients 8 --requests 2 --max-tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time

QUESTION = "Tell me a short story about a lighthouse keeper and a cat."
EVENT = re.compile(rb"data: (.*?)\n\n", re.S)


async def _one_stream(host: str, port: int, body: bytes) -> dict:
    """One streaming request over a raw connection: arrival time and text of each content event."""
    reader, writer = await asyncio.open_connection(host, port)
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    writer.write(head + body)
    await writer.drain()
    buf, times, texts, reads, usage = b"", [], [], 0, None
    while True:
        data = await reader.read(65536)
        now = time.perf_counter()
        if not data:
            break
        reads += 1
        buf += data
        while True:
            m = EVENT.search(buf)
            if m is None:
                break
            buf = buf[m.end() :]
            payload = m.group(1)
            if payload == b"[DONE]":
                continue
            chunk = json.loads(payload)
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                content = choice.get("delta", {}).get("content")
                if content:
                    times.append(now)
                    texts.append(content)
    writer.close()
    return {"times": times, "texts": texts, "reads": reads, "usage": usage}


async def _clients(base: str, model: str, clients: int, requests: int, max_tokens: int) -> list[dict]:
    host, port = base.removeprefix("http://").split(":")

    async def client(i: int) -> list[dict]:
        out = []
        for r in range(requests):
            body = {
                "model": model,
                "user": f"bench-{i}",
                "temperature": 0,
                "max_tokens": max_tokens,
                "stream": True,
                "stream_options": {"include_usage": True},
                "messages": [{"role": "user", "content": QUESTION}],
            }
            one = await _one_stream(host, int(port), json.dumps(body).encode())
            out.append({"client": i, "request": r, **one})
        return out

    return [s for per in await asyncio.gather(*(client(i) for i in range(clients))) for s in per]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--base", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--clients", type=int, required=True)
    p.add_argument("--requests", type=int, required=True)
    p.add_argument("--max-tokens", type=int, required=True)
    a = p.parse_args(argv)
    streams = asyncio.run(_clients(a.base, a.model, a.clients, a.requests, a.max_tokens))
    json.dump(streams, sys.stdout)


if __name__ == "__main__":
    main()

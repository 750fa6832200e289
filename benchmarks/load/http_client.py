"""What the HTTP benchmarks share: a spawned `kvmem serve` on loopback, seeding users through the memory routes,
waiting for a block, and one streaming request through the official openai client timed to first content.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

_WORDS = (
    "apartment mortgage renovation kitchen tiles budget contractor garden sister Lisbon marathon violin "
    "allergy peanut teacher daughter birthday October coffee bicycle manager deadline vacation Kyoto "
    "hiking sourdough recipe cat piano dentist insurance neighbour balcony paint flooring"
).split()
QUERY = "Given everything you remember about me, what should I plan for next month? Keep it short."


def memory_texts(num_memories: int, words_each: int, seed: int = 0) -> list[str]:
    """Deterministic memories; ~words_each * 1.3 tokens each."""
    rng = random.Random(seed)
    return [
        f"Memory {i + 1}: " + " ".join(rng.choice(_WORDS) for _ in range(words_each)) + "."
        for i in range(num_memories)
    ]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout_s: float = 5.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:  # noqa: S310 - loopback only
        return json.loads(r.read())


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=30) as r:  # noqa: S310 - loopback only
        return json.loads(r.read())


REPO_ROOT = Path(__file__).resolve().parents[2]
# `kvmem serve` is the console script serving.ops.cli:main; running the entry point with this checkout first on
# sys.path serves the code under test (the installed script would import whatever tree it was installed from)
KVMEM_SERVE = (
    sys.executable,
    "-c",
    "import sys; from serving.ops.cli import main; sys.exit(main())",
    "serve",
)


@contextmanager
def spawned_server(
    *,
    backend: str,
    model: str | None,
    block_budget: int,
    top_k: int,
    data_dir: str,
    queue_size: int | None = None,
    extra: tuple[str, ...] = (),
    store_turns: bool = False,
):
    """`kvmem serve --no-auth` on 127.0.0.1 at a free port; stopped (terminate, then kill) on exit.
    `queue_size` None: the server's default admission bound. `store_turns` False (the timing benchmarks): chat
    turns are not logged, so no memory is formed from them between measurements.

    Its stderr goes to a file beside data_dir (an unread pipe could fill up and stall the server); the tail
    is shown if it exits early."""
    port = _free_port()
    cmd = [
        *KVMEM_SERVE,
        "--host",
        "127.0.0.1",
        "--no-auth",
        "--port",
        str(port),
        "--data-dir",
        data_dir,
        "--backend",
        backend,
        "--block-token-budget",
        str(block_budget),
        "--retrieve-top-k",
        str(top_k),
        *(() if store_turns else ("--no-store-turns",)),
        "--log-level",
        "warning",
    ]
    if model:
        cmd += ["--model", model]
    if queue_size is not None:
        cmd += ["--queue-size", str(queue_size)]
    cmd += list(extra)  # more `kvmem serve` flags
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(x for x in (str(REPO_ROOT), env.get("PYTHONPATH")) if x)
    log_path = Path(f"{data_dir.rstrip('/')}.stderr.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, env=env, cwd=REPO_ROOT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited ({proc.returncode}): {log_path.read_text()[-2000:]}")
            try:
                if _get(f"{base}/health", 1.0).get("status") == "ok":
                    break
            except OSError:
                pass
            time.sleep(0.25)
        else:
            raise RuntimeError("server did not become ready in 180 s")
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def texts_digest(texts: list[str]) -> str:
    return hashlib.sha256(json.dumps(sorted(texts)).encode()).hexdigest()[:16] if texts else ""


def seed(base: str, user: str, texts: list[str]) -> None:
    for text in texts:
        _post(f"{base}/v1/memories", {"user_id": user, "text": text})


def wait_for_block(base: str, user: str, expected: int, timeout_s: float = 300) -> dict:
    """Poll the plan route until the user's block is built (not null) and holds all `expected` memories.

    Only polls: every memory added through the API makes the server refresh the user's plan, so the block is
    built (and grows a memory at a time while seeding) without any chat traffic that would add heat."""
    _post(f"{base}/v1/memories/plan/prewarm", {"user_id": user})  # for memories stored before the start
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        plan = _get(f"{base}/v1/memories/plan?user_id={user}")
        if plan["block"] is not None and len(plan["block"]["memory_ids"]) >= expected:
            return plan
        time.sleep(0.25)
    raise RuntimeError(f"no KV block of {expected} memories for {user} after {timeout_s} s")


@dataclass(frozen=True)
class Reply:
    ttft_s: float  # to the first content chunk
    cached_tokens: int
    prompt_tokens: int
    completion_tokens: int
    memory_used: tuple[tuple[str, str], ...] = ()  # (id, tier) from the response's `memory` field
    replica: str | None = None  # the X-Kvmem-Replica header (which replica answered)
    text: str = ""  # the streamed content


def one_request(
    base: str,
    user: str,
    max_tokens: int,
    question: str = QUERY,
    client=None,
    system: str | None = None,
    headers: dict[str, str] | None = None,
    messages: list[dict[str, str]] | None = None,
    model: str = "default",
) -> Reply:
    """One streaming chat through the official openai client, timed to the first content chunk. `system`: a
    client system message first (it sits right after the memory block in the prompt); `headers`: extra request
    headers (X-Kvmem-User for a router); `messages`: the whole conversation instead of `system` + `question`;
    `model`: the name the server serves (a plain vLLM server: its model path)."""
    if client is None:
        from openai import OpenAI

        client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=600)
    start = time.perf_counter()
    ttft, usage, used, text = None, None, (), []
    if messages is None:
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": question}
        ]
    raw = client.chat.completions.with_raw_response.create(
        model=model,
        extra_headers=headers,
        user=user,
        temperature=0,
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
        messages=messages,
    )
    stream = raw.parse()
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text.append(chunk.choices[0].delta.content)
            if ttft is None:
                ttft = time.perf_counter() - start
        if chunk.usage is not None:
            usage = chunk.usage
        memory = (chunk.model_extra or {}).get("memory")
        if memory:
            used = tuple((m["id"], m["tier"]) for m in memory.get("used", []))
    return Reply(
        ttft if ttft is not None else time.perf_counter() - start,
        # a plain vLLM server reports it only with --enable-prompt-tokens-details
        (usage.prompt_tokens_details.cached_tokens or 0) if usage and usage.prompt_tokens_details else 0,
        usage.prompt_tokens if usage else 0,
        usage.completion_tokens if usage else 0,
        used,
        raw.headers.get("x-kvmem-replica"),
        "".join(text),
    )


def server_totals(base: str) -> dict[str, tuple[float, int]]:
    """(sum of seconds, count) of the server's histograms by name ("ttft": arrival -> first token; "prefill":
    the backend's inject + prefill share of it); {} for a server without them."""
    try:
        with urllib.request.urlopen(f"{base}/metrics", timeout=5) as r:  # noqa: S310 - loopback only
            text = r.read().decode()
    except OSError:
        return {}
    found: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name.startswith(("kvmem_ttft_seconds_", "kvmem_prefill_seconds_")):
            found[name] = float(value)
    return {
        key: (found[f"kvmem_{key}_seconds_sum"], int(found[f"kvmem_{key}_seconds_count"]))
        for key in ("ttft", "prefill")
        if f"kvmem_{key}_seconds_sum" in found and f"kvmem_{key}_seconds_count" in found
    }


def server_means(before: dict, after: dict) -> dict[str, float]:
    """Mean seconds per histogram over the requests between two server_totals snapshots."""
    return {
        key: (after[key][0] - before[key][0]) / (after[key][1] - before[key][1])
        for key in after
        if key in before and after[key][1] > before[key][1]
    }

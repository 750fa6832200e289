"""The many-users benchmark's client, one per arm: each user's memories, conversation and canary as the client
knows them; asks (one streaming request through the openai client, timed), edits (PATCH of the canary memory on a
kvmem server, a new pasted text elsewhere), the sample of greedy answers compared with a cold prefill, and the
waits on a kvmem server before an arm's clock starts (every user's block built, the scheduler idle)."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections import Counter

from benchmarks.load.http_client import _get, _post, one_request
from benchmarks.tiers import many_users_arms as arms_mod
from benchmarks.tiers.many_users_workload import PROBE, QUESTIONS, CanaryLedger, User, canary_text


def pasted(system: str, user: User, code: str) -> str:
    """The system prompt of a pasted arm: the shared prompt, then the user's memories and canary as text."""
    return (
        system + "\n\nWhat you remember about this user:\n" + "\n".join([*user.memories, canary_text(code)])
    )


class Client:
    """One arm's client state: each user's memories (as the client knows them), conversation and canary."""

    def __init__(self, arm: str, server, users: list[User], system: str, args) -> None:
        self.arm, self.server, self.users, self.system, self.args = arm, server, users, system, args
        self.pasted = arm in arms_mod.PASTED
        self.ledger = CanaryLedger()
        self.canary_ids: dict[str, str] = {}  # kvmem arms: the canary memory's id
        self.history: dict[str, list[dict[str, str]]] = {}
        self.lock = threading.Lock()
        self.t0 = time.monotonic()
        from openai import OpenAI

        timeout = getattr(args, "request_timeout_s", None) or 600.0  # a request past it counts as "timeout"
        self.openai = OpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0, timeout=timeout)

    def now(self) -> float:
        return time.monotonic() - self.t0

    def seed(self) -> None:
        """kvmem arms: store every user's memories and canary, then wait until each block is built."""
        for user in self.users:
            if not self.pasted:
                for text in user.memories:
                    _post(f"{self.server.base}/v1/memories", {"user_id": user.user_id, "text": text})
                out = _post(
                    f"{self.server.base}/v1/memories",
                    {"user_id": user.user_id, "text": canary_text(user.canary)},
                )
                self.canary_ids[user.user_id] = out["memories"][0]["id"]
            self.ledger.set(user.user_id, user.canary, self.now())

    def messages(self, user: User, question: str, round_: int) -> list[dict[str, str]]:
        system = self.system
        if self.pasted:
            code = self.ledger.current(user.user_id)
            system = pasted(system, user, code)
        with self.lock:
            past = [] if round_ == 0 else list(self.history.get(user.user_id, []))
        return [{"role": "system", "content": system}, *past, {"role": "user", "content": question}]

    def ask(self, user: User, question: str, round_: int) -> dict:
        msgs = self.messages(user, question, round_)
        sent = self.now()
        current = self.ledger.current(user.user_id)
        row = {"user_rank": user.rank, "round": round_, "probe": question == PROBE, "sent_at": sent}
        first = time.perf_counter()
        retries = 0
        while True:
            try:
                started = time.perf_counter()
                reply = one_request(
                    self.server.base,
                    user.user_id,
                    self.args.answer_len,
                    client=self.openai,
                    messages=msgs,
                    model=self.server.model,
                )
                break
            except Exception as exc:  # noqa: BLE001 - counted by type and reported
                if type(exc).__name__ == "RateLimitError" and retries < self.args.retries_429:
                    # as the openai client does by default: wait what Retry-After says, then again
                    retries += 1
                    time.sleep(retry_after(exc))
                    continue
                return {**row, "retries_429": retries, "error": error_kind(exc) + ": " + str(exc)[:200]}
        row["retries_429"] = retries
        # the user's wait: from the first attempt, 429s and their pauses included
        row["ttft_first_attempt_s"] = started - first + reply.ttft_s
        with self.lock:
            past = [] if round_ == 0 else self.history.get(user.user_id, [])
            self.history[user.user_id] = [
                *past,
                {"role": "user", "content": question},
                {"role": "assistant", "content": reply.text},
            ]
        row.update(
            ttft_s=reply.ttft_s,
            completion_tokens=reply.completion_tokens,
            prompt_tokens=reply.prompt_tokens,
            cached_tokens=reply.cached_tokens,
            tiers=dict(Counter(t for _, t in reply.memory_used)),
            done_at=self.now(),
        )
        if row["probe"]:
            row["canary"] = self.ledger.judge(user.user_id, sent, reply.text, current)
        return row

    def edit(self, user: User, code: str) -> dict:
        """Change the user's canary; returns the probe asked right after the edit returned."""
        try:
            if not self.pasted:
                urllib_patch(
                    f"{self.server.base}/v1/memories/{self.canary_ids[user.user_id]}",
                    {"user_id": user.user_id, "text": canary_text(code)},
                )
        except Exception as exc:  # noqa: BLE001
            return {"user_rank": user.rank, "edit_error": "edit " + error_kind(exc) + ": " + str(exc)[:200]}
        self.ledger.set(user.user_id, code, self.now())
        return {**self.ask(user, PROBE, 0), "after_edit": True}


def retry_after(exc: Exception, default_s: float = 0.5, max_s: float = 5.0) -> float:
    """Seconds an openai 429 asks to wait (its Retry-After header), within [0, max_s]."""
    try:
        return min(max_s, max(0.0, float(exc.response.headers.get("retry-after", default_s))))
    except (AttributeError, TypeError, ValueError):
        return default_s


def urllib_patch(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), method="PATCH", headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:  # noqa: S310 - loopback only
        return json.loads(r.read())


def sample_prompts(client: Client, args) -> list[dict]:
    """A few greedy answers at idle, fresh conversations, with the prompt the server saw (for the cold
    prefill in this process): pasted arms their messages, kvmem arms the block's texts from the plan."""
    from benchmarks.ttft.http_ttft import block_texts

    out = []
    n = len(client.users)
    for k in sorted({0, n // 2, n - 1})[: args.samples]:
        user = client.users[k]
        msgs = client.messages(user, QUESTIONS[0], 0)
        reply = one_request(
            client.server.base,
            user.user_id,
            args.answer_len,
            client=client.openai,
            messages=msgs,
            model=client.server.model,
        )
        entry = {
            "user_rank": user.rank,
            "messages": msgs,
            "answer": reply.text,
            "cached_tokens": reply.cached_tokens,
            "prompt_tokens": reply.prompt_tokens,
        }
        if not client.pasted and client.arm != "kvmem-fake":
            try:
                entry["block_texts"] = block_texts(client.server.base, user.user_id)
            except (TypeError, KeyError, OSError):
                entry["block_texts"] = None  # no block now: the server prefilled the memories as text
        out.append(entry)
    return out


def cold_answers(samples: dict[str, list[dict]], model: str | None, answer_len: int) -> None:
    """Greedy answers of the same prompts by a cold prefill in this process (transformers), set as `cold` and
    `same` on each sample: vLLM arms' prompts by the chat template, kvmem arms' by the server's layout."""
    from kvmem.kv import PromptLayout
    from kvmem.models import load_model

    handle = load_model(model, device="cpu", dtype="float32")
    layout = PromptLayout(handle.tokenizer)
    for arm, entries in samples.items():
        for e in entries:
            try:
                cold_one(handle, layout, arm, e, answer_len)
            except Exception as exc:  # noqa: BLE001 - the reference failed, the run's figures stay
                e["cold"], e["same"], e["cold_error"] = None, None, f"{type(exc).__name__}: {exc}"[:300]


def cold_one(handle, layout, arm: str, e: dict, answer_len: int) -> None:
    import torch

    if arm.startswith("vllm"):
        ids = handle.tokenizer.apply_chat_template(
            e["messages"], add_generation_prompt=True, return_dict=False
        )
    elif e.get("block_texts") is None and arm != "text":
        e["cold"], e["same"] = (
            None,
            None,
        )  # no block when sampled: what the server prefilled is not known here
        return
    else:
        ids = layout.prompt(e.get("block_texts") or [], [], e["messages"]).ids
    with torch.inference_mode():
        out = handle.model.generate(
            torch.tensor([list(ids)]),
            max_new_tokens=answer_len,
            do_sample=False,
            pad_token_id=handle.tokenizer.eos_token_id,
        )
    e["cold"] = handle.tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)
    e["cold_prompt_tokens"] = len(
        ids
    )  # the server's `prompt_tokens` for the same prompt, if the layouts agree
    e["same"] = e["cold"].strip() == e["answer"].strip()


def error_kind(exc: BaseException) -> str:
    """What went wrong, as the JSON counts it: "timeout", "connection", "http <status> <error code>" (the
    server's error body, docs/API.md), or the exception's type."""
    name = type(exc).__name__
    if "Timeout" in name or isinstance(exc, TimeoutError):
        return "timeout"
    if "Connection" in name or isinstance(exc, ConnectionError):
        return "connection"
    status = getattr(exc, "status_code", None) or getattr(exc, "code", None)
    if isinstance(status, int):
        body = getattr(exc, "body", None)
        code = body.get("code") or body.get("type") if isinstance(body, dict) else None
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            code = body["error"].get("code") or body["error"].get("type")
        return f"http {status}" + (f" {code}" if code else "")
    return name


def reference_request_s(
    model: str | None, users: list[User], system: str, answer_len: int, repeats: int = 3
) -> dict:
    """The machine's pace, measured in this process before any arm runs: the seconds one text request takes
    alone (a cold prefill of the shared system prompt, the memories of the user whose block is nearest the
    mean size pasted as the text arm pastes them, and the first question; then `answer_len` greedy tokens),
    the median of `repeats` after a warm-up. Offered rates given as load factors are divided by it, so a sweep
    loads a slower machine as much as a faster one and runs taken on different days compare."""
    import statistics

    import torch

    from kvmem.models import load_model

    if not users or answer_len < 1 or repeats < 1:
        raise ValueError("reference_request_s: needs users, answer_len >= 1 and repeats >= 1")
    mean = sum(u.memory_tokens for u in users) / len(users)
    user = min(users, key=lambda u: (abs(u.memory_tokens - mean), u.rank))
    messages = [
        {"role": "system", "content": pasted(system, user, user.canary)},
        {"role": "user", "content": QUESTIONS[0]},
    ]
    handle = load_model(model, device="cpu", dtype="float32")
    ids = torch.tensor(
        [handle.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)]
    )
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 1):  # the first is the warm-up
            t = time.perf_counter()
            handle.model.generate(
                ids,
                max_new_tokens=answer_len,
                min_new_tokens=answer_len,
                do_sample=False,
                pad_token_id=handle.tokenizer.eos_token_id,
            )
            times.append(time.perf_counter() - t)
    return {
        "reference_s": statistics.median(times[1:]),
        "times_s": times[1:],
        "warmup_s": times[0],
        "prompt_tokens": int(ids.shape[1]),
        "answer_len": answer_len,
        "user_rank": user.rank,
        "torch_threads": torch.get_num_threads(),
    }


def wait_all_blocks(base: str, users: list[User], timeout_s: float, reprewarm_s: float = 30.0) -> list[str]:
    """Poll until every user's plan has a block, asking again (prewarm) every `reprewarm_s` for those still
    without one (a build can fail, or a block be dropped, before the clock starts); the users still without a
    block after `timeout_s`."""
    start = time.monotonic()
    asked = start
    pending = [u.user_id for u in users]
    while pending and time.monotonic() - start < timeout_s:
        pending = [u for u in pending if _get(f"{base}/v1/memories/plan?user_id={u}")["block"] is None]
        if pending and time.monotonic() - asked >= reprewarm_s:
            for u in pending:
                _post(f"{base}/v1/memories/plan/prewarm", {"user_id": u})
            asked = time.monotonic()
        if pending:
            # each sweep reads every pending plan: a slower poll leaves the cores to the builds
            time.sleep(2.0)
    return pending


def wait_scheduler_idle(base: str, timeout_s: float) -> float | None:
    """Poll the server's /metrics until its scheduler holds no task (kvmem_scheduler_queue_depth: waiting or
    running); the seconds that took, None when the server does not say or it is still busy after `timeout_s`."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        depth = arms_mod.scrape(base).get("kvmem_scheduler_queue_depth")
        if depth is None:
            return None
        if depth == 0:
            return time.monotonic() - start
        time.sleep(1.0)
    return None

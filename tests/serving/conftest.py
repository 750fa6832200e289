"""Shared fixtures: an app over the fake backend and the server's own scheduler (no worker thread: a test runs
its tasks with `stack.scheduler.flush()`), and a live uvicorn server on 127.0.0.1 for client tests."""

from __future__ import annotations

import itertools
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.testclient import TestClient

import kvmem.text
from scheduler import Scheduler, SchedulerConfig
from scheduler.wiring import make_scheduler
from serving.backends.fake import FakeBackend
from serving.config import ServingConfig
from serving.http.app import create_app

KEYS = {"sk-alice-0000": ["alice"], "sk-bob-00000": ["bob"], "sk-team-0000": ["alice", "bob"]}
ALICE = {"Authorization": "Bearer sk-alice-0000"}
BOB = {"Authorization": "Bearer sk-bob-00000"}
TEAM = {"Authorization": "Bearer sk-team-0000"}
MODEL = "kvmem-fake"


class TickClock:
    """Seconds that advance by one at every read. Each store change is seen at its own instant, so with equal
    heat otherwise the newest memory is the hottest: block order is exact, not a tie broken by random ids."""

    def __init__(self, start: float = 1_000_000.0) -> None:
        self._ticks = itertools.count()
        self.start = start

    def __call__(self) -> float:
        return self.start + next(self._ticks)


@dataclass
class Stack:
    app: FastAPI
    backend: FakeBackend
    store: Any
    scheduler: Scheduler
    config: ServingConfig


def make_stack(
    tmp_path: Path,
    *,
    auth: bool = True,
    backend: FakeBackend | None = None,
    budget: int = 2048,
    scheduler_config: SchedulerConfig | None = None,
    **config_kw: Any,
) -> Stack:
    """The server's app and scheduler (`make_scheduler`, as `create_app` builds it) over the fake backend;
    the scheduler's clock is a TickClock and it runs no thread."""
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": KEYS}))
    config = ServingConfig(
        data_dir=tmp_path,
        backend="fake",
        auth=auth,
        api_keys_file=keys,
        block_token_budget=budget,
        **config_kw,
    )
    backend = backend or FakeBackend()
    store = kvmem.text.MemoryStore(tmp_path / "memories.sqlite")
    scheduler = make_scheduler(config, store, backend, scheduler_config=scheduler_config, clock=TickClock())
    scheduler.start(thread=False)
    app = create_app(config, backend=backend, store=store, scheduler=scheduler)
    return Stack(app, backend, store, scheduler, config)


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    s = make_stack(tmp_path)
    yield s
    s.scheduler.stop()


@pytest.fixture
def client(stack: Stack) -> Iterator[TestClient]:
    with TestClient(stack.app) as c:
        yield c


@contextmanager
def live_server(app: FastAPI) -> Iterator[str]:
    """Serve `app` on 127.0.0.1 at a free port in a thread; yields the base URL; stops at exit."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    for _ in range(500):  # bounded: 10 s at most
        if server.started:
            break
        time.sleep(0.02)
    assert server.started, "server did not start"
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def wait_for(predicate: Any, what: str, tries: int = 500) -> None:
    """Poll `predicate` (bounded, 10 s at most); fail naming `what`."""
    for _ in range(tries):
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def tiny_backend(tiny_model_dir, tmp_path_factory):
    """The transformers backend over the tiny llama, loaded (per module)."""
    import asyncio

    from serving.backends.transformers.backend import TransformersBackend, TransformersBackendConfig

    backend = TransformersBackend(
        TransformersBackendConfig(model=str(tiny_model_dir), data_dir=str(tmp_path_factory.mktemp("data")))
    )
    backend.load()
    yield backend
    asyncio.run(backend.aclose())

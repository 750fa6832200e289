"""A server stack for tests that need the real KV store: the tiny random llama behind the transformers backend,
the scheduler as plan provider, a plaintext store with the hash embedder, all over one data dir."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

from kvmem.datadir import DataDir
from kvmem.text import HashEmbedder, MemoryStore
from scheduler import Scheduler
from scheduler.wiring import make_scheduler
from serving.backends.transformers.backend import TransformersBackend, TransformersBackendConfig
from serving.config import ServingConfig
from serving.http.app import create_app


def save_tiny_model(directory: Path, handle: Any) -> Path:
    handle.model.save_pretrained(directory)
    handle.tokenizer.save_pretrained(directory)
    return directory


def load_backend(model_dir: Path, data_dir: Path, **config: Any) -> TransformersBackend:
    backend = TransformersBackend(
        TransformersBackendConfig(model=str(model_dir), data_dir=str(data_dir), **config)
    )
    backend.load()
    return backend


@dataclass
class Served:
    client: TestClient
    plans: Scheduler
    backend: TransformersBackend
    store: MemoryStore

    def add(self, user: str, text: str, session: str | None = None) -> str:
        body = {"user_id": user, "text": text, **({"session_id": session} if session else {})}
        r = self.client.post("/v1/memories", json=body)
        assert r.status_code == 201, r.text
        [memory] = r.json()["memories"]
        return memory["id"]

    def plan(self, user: str) -> dict:
        r = self.client.get("/v1/memories/plan", params={"user_id": user})
        assert r.status_code == 200, r.text
        return r.json()["block"]

    def chat(self, user: str, text: str = "Where do I live?") -> dict:
        body = {
            "model": "default",
            "user": user,
            "messages": [{"role": "user", "content": text}],
            "max_tokens": 2,
            "temperature": 0,
        }
        r = self.client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()


@contextmanager
def served(data_dir: Path, backend: TransformersBackend, **settings: Any) -> Iterator[Served]:
    """The HTTP app over `backend` with the scheduler (its worker thread running) as plan provider; `settings`:
    more ServingConfig fields (block_token_budget defaults to 4096)."""
    store = MemoryStore(data_dir / "memories.sqlite", embedder=HashEmbedder())
    config = ServingConfig(
        data_dir=data_dir,
        backend="transformers",
        auth=False,
        store_turns=False,
        **{"block_token_budget": 4096, **settings},
    )
    plans = make_scheduler(config, store, backend)
    plans.start()
    try:
        with TestClient(create_app(config, backend=backend, store=store, scheduler=plans)) as client:
            yield Served(client, plans, backend, store)
    finally:
        plans.stop()
        store.close()
        asyncio.run(backend.aclose())


def json_texts(data_dir: Path) -> dict[str, str]:
    """The text of every *.json file under the data dir, by path relative to it."""
    root = DataDir.at(data_dir).root
    return {str(p.relative_to(root)): p.read_text() for p in sorted(root.rglob("*.json"))}


def manifests(data_dir: Path) -> dict[str, tuple[str, tuple[str, ...]]]:
    """Every KV item manifest under the data dir: item id -> (user id, memory ids)."""
    out = {}
    for text in json_texts(data_dir).values():
        meta = json.loads(text).get("meta")
        if isinstance(meta, dict) and "memory_ids" in meta:
            out[meta["item_id"]] = (meta["user_id"], tuple(meta["memory_ids"]))
    return out

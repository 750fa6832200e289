"""Shutdown (SIGTERM: the app's lifespan stops the scheduler) cancels a block build in flight instead of
waiting for it: the build ends at its next step with nothing stored, and a restart rebuilds what it needs.
Over the real transformers backend (the tiny llama), whose model thread is held inside the build's second
chunk until the cancel arrives, so the build is in flight, deterministically, when the scheduler stops."""

from __future__ import annotations

import asyncio
import threading

from kvmem.text import HashEmbedder, MemoryStore
from scheduler.wiring import make_scheduler
from serving.config import ServingConfig
from tests.conftest import EngineForwards
from tests.serving.kvstack import load_backend

CHUNK_TOKENS = 16


def test_stopping_the_scheduler_cancels_the_block_build_in_flight(tmp_path, tiny_model_dir) -> None:
    backend = load_backend(
        tiny_model_dir, tmp_path, prefill_chunk_tokens=CHUNK_TOKENS, build_chunk_tokens=CHUNK_TOKENS
    )
    store = MemoryStore(tmp_path / "m.sqlite", embedder=HashEmbedder())
    config = ServingConfig(data_dir=tmp_path, backend="transformers", auth=False, block_token_budget=4096)
    plans = make_scheduler(config, store, backend)
    texts = [f"note {i}: the meeting about project {i} moved to room {i + 7}" for i in range(30)]
    assert sum(backend.count_tokens(t) for t in texts) > 10 * CHUNK_TOKENS  # its build runs many chunks
    store.add("alice", texts=texts)
    pages_before = backend.engine_stats()["pages_used"]
    forwards: list[int] = []
    held, cancelled = threading.Event(), threading.Event()

    def hold_the_second_chunk(ids) -> None:  # on the model thread
        forwards.append(1)
        if len(forwards) == 2:
            held.set()
            cancelled.wait(10)

    real_cancel = getattr(backend, "cancel_builds", lambda: 0)
    cancels: list[int] = []

    def cancel_builds() -> int:
        cancels.append(real_cancel())
        cancelled.set()
        return cancels[-1]

    backend.cancel_builds = cancel_builds
    outcomes: list[str] = []
    real_build = plans.builder.build_block

    def build_block(*args, **kwargs):
        try:
            built = real_build(*args, **kwargs)
        except Exception as exc:
            outcomes.append(type(exc).__name__)
            raise
        outcomes.append("built")
        return built

    plans.builder.build_block = build_block
    hook = EngineForwards(hold_the_second_chunk)
    try:
        plans.start()
        plans.session_start("alice")  # a refresh: alice's block is built
        assert held.wait(30)  # the build is in its second chunk
        plans.stop()
        assert cancels == [1] and outcomes == ["BuildCancelled"]
        assert len(forwards) <= 3  # it ended at the step boundary after the cancel, not after all its chunks
        assert plans.plans.get("alice").block is None and backend.stored_memory_ids("alice") == []
        assert backend.engine_stats()["pages_used"] == pages_before  # its pages went back
    finally:
        cancelled.set()
        hook.remove()
        plans.stop()
        asyncio.run(backend.aclose())
        store.close()

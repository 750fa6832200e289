"""What the server does once at start, off the request path: load the model, restore the stored plans, freeze
the loaded heap (`kvmem serve`), seed the demo user."""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
from typing import Any

from kvmem.formation.rules import slot_of
from scheduler import Scheduler
from serving.backends.base import Backend
from serving.config import ServingConfig

logger = logging.getLogger("serving.http.app")

# one fact a memory, as formation keeps them (a move or a new job retires one line, never a neighbour)
DEMO_MEMORIES = (
    "My name is Dana.",
    "I live in Lisbon.",
    "I am allergic to peanuts.",
    "I have a golden retriever called Miso.",
    "I work as a marine biologist.",
    "I study octopuses.",
    "My favourite programming language is Python.",
)


async def load_and_restore(
    backend: Backend, store: Any, config: ServingConfig, scheduler: Scheduler, restored: threading.Event
) -> None:
    """Load the model off the event loop, restore the stored plans, seed the demo user. /health says ok once
    the plans are restored; failures leave it at 503, with a log line."""
    try:
        if not backend.is_ready():
            await asyncio.to_thread(backend.load)
        logger.info("backend %s ready: model %s", backend.name, backend.model_id)
    except Exception:
        logger.exception("loading the %s backend failed; /health stays 503", backend.name)
    else:
        try:
            n = await asyncio.to_thread(scheduler.restore)  # plans survive restarts; builds nothing
            logger.info("restored %d users' plans from stored KV items", n)
            if config.freeze_heap:
                logger.info("froze %d objects of the loaded server out of the cyclic GC", freeze_heap())
        finally:
            restored.set()
    if config.seed_demo and await asyncio.to_thread(store.count, config.default_user) == 0:
        await asyncio.to_thread(
            store.add,
            config.default_user,
            texts=list(DEMO_MEMORIES),
            session_id="demo",
            slots=[slot_of(t) for t in DEMO_MEMORIES],
        )
        logger.info("seeded user %r with %d demo memories", config.default_user, len(DEMO_MEMORIES))


def freeze_heap() -> int:
    """Collect, then move every object alive now out of the cyclic garbage collector's reach (`gc.freeze`);
    returns how many are frozen. A full collection in a loaded server (~390k objects: the modules, the
    model's modules, the app) took ~0.2 s here, holding the GIL: each one that fell due stalled every stream
    (7 of them in a 2-minute build_stall run). Objects made later are collected as before."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()

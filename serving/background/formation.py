"""The server's memory formation: the extractor `ServingConfig.extractor` names, and the background worker
(scheduler.formation) that forms memories from the conversation log's user turns.

Builds them at the edge from the config; `None` when turns are not logged or the extractor is "none". Knows
nothing of HTTP.
"""

from __future__ import annotations

import logging
from typing import Any

from kvmem.formation.base import make_extractor
from scheduler.formation import FormationConfig, FormationWorker
from serving.config import ServingConfig
from serving.http.metrics import gauge_lines

log = logging.getLogger(__name__)


def make_formation(
    config: ServingConfig, store: Any, formation_config: FormationConfig | None = None, backend: Any = None
) -> FormationWorker | None:
    """The formation worker for this server (not started), or None when nothing is to be formed. "self" forms
    with `backend`'s model (its decisions too: kvmem/formation/self_model.py), or with the rules when the
    backend serves no response format (the fake one, or none given)."""
    if not config.store_turns or config.extractor == "none":
        return None
    if config.extractor == "self":
        if backend is not None and "response_format" in backend.sampling_features:
            from serving.background.self_generate import backend_generate

            extractor = make_extractor("self", generate=backend_generate(backend))
            return FormationWorker(store, extractor, formation_config, decider=extractor.decide)
        log.warning(
            "extractor self: the %s backend serves no response format; forming with the rules",
            getattr(backend, "name", "missing"),
        )
        return FormationWorker(store, make_extractor("rules"), formation_config)
    if config.extractor == "openai":
        extractor = make_extractor(
            "openai",
            url=config.extractor_url,
            model=config.extractor_model,
            api_key=config.extractor_api_key,
            timeout_s=config.extractor_timeout_s,
        )
    else:
        extractor = make_extractor(config.extractor)
    return FormationWorker(store, extractor, formation_config)


_STATS = (  # (metric, help, FormationStats field): the worker's counters since start
    ("kvmem_formation_queued_users", "Users queued for formation.", "queued_users"),
    ("kvmem_formation_formed_turns_total", "Log turns formed.", "formed_turns_total"),
    ("kvmem_formation_memories_added_total", "Memories formed.", "memories_added_total"),
    ("kvmem_formation_superseded_total", "Memories superseded by newer ones.", "superseded_total"),
    ("kvmem_formation_duplicates_total", "Formed facts merged into an existing memory.", "duplicates_total"),
    (
        "kvmem_formation_failures_total",
        "Failed formation passes (retried or dead-lettered).",
        "failures_total",
    ),
    (
        "kvmem_formation_circuit_open",
        "1 while the extractor's circuit is open (it failed repeatedly; one probe pass at a time).",
        "circuit_open",
    ),
    (
        "kvmem_formation_overflowed_total",
        "Users refused by the full formation queue (picked up by the next rescan).",
        "overflowed_total",
    ),
    (
        "kvmem_formation_stale_total",
        "Formation passes whose user's memories changed while they decided (nothing written; decided again).",
        "stale_total",
    ),
)


def formation_health(worker: FormationWorker | None, counts: Any) -> dict[str, Any]:
    """/health's `formation`: the extractor, the log's pending and dead-lettered turns (None: the store's
    server is away), the circuit, and the last failure's kind and time. Never a failure's text: it may quote
    an extractor's reply, which may repeat what a user said (the user's own `GET /v1/memories/formation` has
    it)."""
    stats = worker.stats if worker is not None else None
    last_error = None
    if stats is not None and stats.last_error_kind is not None:
        last_error = {"kind": stats.last_error_kind, "at": stats.last_error_at}
    return {
        "extractor": worker.extractor.name if worker is not None else None,
        "pending_turns": counts.pending if counts else None,
        "dead_turns": counts.dead if counts else None,
        "circuit": stats.circuit if stats is not None else None,
        "circuit_until": stats.circuit_until if stats is not None else None,
        "last_error": last_error,
    }


def formation_metrics(worker: FormationWorker | None, counts: Any) -> str:
    """Prometheus lines: the log's pending and dead-lettered turns (durable, all users) and the worker's
    counters since start (0 without a worker). `counts` None (the store's server is away): no log gauges."""
    gauges = []
    if counts is not None:
        gauges += [
            (
                "kvmem_formation_pending_turns",
                "Log turns waiting to be formed into memories.",
                counts.pending,
            ),
            ("kvmem_formation_dead_turns", "Log turns dead-lettered by formation.", counts.dead),
        ]
    gauges += [(m, h, getattr(worker.stats, f) if worker else 0) for m, h, f in _STATS]
    return gauge_lines(gauges)

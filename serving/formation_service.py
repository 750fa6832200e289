"""The server's memory formation: the extractor `ServingConfig.extractor` names, and the background worker
(scheduler.formation) that forms memories from the conversation log's user turns.

Builds them at the edge from the config; `None` when turns are not logged or the extractor is "none". Knows
nothing of HTTP.
"""

from __future__ import annotations

from typing import Any

from kvmem.formation.base import make_extractor
from scheduler.formation import FormationConfig, FormationWorker
from serving.config import ServingConfig


def make_formation(
    config: ServingConfig, store: Any, formation_config: FormationConfig | None = None
) -> FormationWorker | None:
    """The formation worker for this server (not started), or None when nothing is to be formed."""
    if not config.store_turns or config.extractor == "none":
        return None
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


def formation_metrics(worker: FormationWorker | None, counts: Any) -> str:
    """Prometheus lines: the log's pending and dead-lettered turns (durable, all users) and the worker's
    counters since start."""
    st = worker.stats if worker is not None else None
    gauges = [
        ("kvmem_formation_pending_turns", "Log turns waiting to be formed into memories.", counts.pending),
        (
            "kvmem_formation_dead_turns",
            "Log turns dead-lettered by formation (see /v1/memories/formation).",
            counts.dead,
        ),
        ("kvmem_formation_queued_users", "Users queued for formation.", st.queued_users if st else 0),
        ("kvmem_formation_formed_turns_total", "Log turns formed.", st.formed_turns_total if st else 0),
        ("kvmem_formation_memories_added_total", "Memories formed.", st.memories_added_total if st else 0),
        (
            "kvmem_formation_superseded_total",
            "Memories superseded by newer ones.",
            st.superseded_total if st else 0,
        ),
        (
            "kvmem_formation_duplicates_total",
            "Formed facts merged into an existing memory.",
            st.duplicates_total if st else 0,
        ),
        (
            "kvmem_formation_failures_total",
            "Failed formation passes (retried or dead-lettered).",
            st.failures_total if st else 0,
        ),
        (
            "kvmem_formation_overflowed_total",
            "Users refused by the full formation queue (picked up by the next rescan).",
            st.overflowed_total if st else 0,
        ),
    ]
    lines = []
    for name, help_text, value in gauges:
        kind = "counter" if name.endswith("_total") else "gauge"
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {value!r}"]
    return "\n".join(lines) + "\n"

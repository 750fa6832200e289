"""`kvmem serve --distill`: the parametric tier kept up to date in the background of the server.

A sweep thread wakes every `config.distill_interval_s` seconds (never on the request path) and, once the backend
is loaded, hands to `scheduler.distill.job.DistillThread` (one job at a time, nice 19, one torch thread) each user
held in the plan book whose distillation candidates (the scheduler's selection policy, computed by its worker
on every refresh) are not all trained into the adapter served to them (whether or not it is served for them)
and were not already tried as they are now;
at most `MAX_SUBMITS_PER_SWEEP` users per sweep. A store change that stops a user's adapter (the delete
cascade, before the call returns) queues that user at once: a new version without the changed memory is
trained, gated and activated only if it passes (scheduler.distill.job.distill_user, the CLI's job).

Training runs on a private copy of the served model loaded from the same files (its fingerprint must equal the
served one's, so the adapter's base-model binding holds): the served model is wrapped by peft in place and
switched by the model thread, so the training thread never touches it. Knows nothing of HTTP.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from scheduler import Scheduler
from scheduler.distill.job import DistillConfig, DistillOutcome, DistillThread, distill_user
from scheduler.distill.model_augment import Generate
from scheduler.distill.selection import SelectConfig
from serving.config import ServingConfig

log = logging.getLogger(__name__)

MAX_SUBMITS_PER_SWEEP = 8  # users queued by one sweep at most (jobs run one at a time anyway)
MAX_TRIED = 4096  # users whose last job's candidates the sweep remembers


def server_distill_config(scheduler: Scheduler) -> DistillConfig:
    """The jobs' settings: selection by the scheduler's own thresholds (as `kvmem distill` does), the training
    and gate defaults."""
    c = scheduler.config
    return DistillConfig(
        select=SelectConfig(
            min_stable_s=c.distill_min_stable_s, min_uses=c.distill_min_uses, half_life_s=c.half_life_s
        )
    )


class BackgroundDistill:
    def __init__(
        self,
        config: ServingConfig,
        store: Any,
        scheduler: Scheduler,
        backend: Any,
        distill_config: DistillConfig | None = None,
        *,
        load_handle: Callable[[], Any] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        from kvmem.adapters import AdapterRegistry
        from kvmem.datadir import DataDir

        self.config, self.store, self.scheduler, self.backend = config, store, scheduler, backend
        self.distill_config = distill_config or server_distill_config(scheduler)
        self.registry = AdapterRegistry(DataDir.at(config.data_dir).adapters_dir)
        self.clock = clock
        self._load_handle = load_handle or self._load_private_handle
        self._handle: Any = None
        # user -> the candidates of their last job, the most recent MAX_TRIED users' (one forgotten is tried
        # once more at worst)
        self._tried: OrderedDict[str, frozenset[str]] = OrderedDict()
        self._tried_lock = threading.Lock()
        self.thread = DistillThread(self._job)
        self._stop = threading.Event()
        self._sweeper = threading.Thread(target=self._sweep_loop, name="kvmem-distill-sweep", daemon=True)
        scheduler.adapter_stopped.append(self.on_adapter_stopped)

    def start(self) -> None:
        self._sweeper.start()

    def close(self) -> None:
        self._stop.set()
        if self.on_adapter_stopped in self.scheduler.adapter_stopped:
            self.scheduler.adapter_stopped.remove(self.on_adapter_stopped)
        self.thread.close()
        if self._sweeper.is_alive():
            self._sweeper.join(timeout=5)

    # -- what gets queued ------------------------------------------------------------------------------------
    def on_adapter_stopped(self, user_id: str) -> None:
        """The scheduler stopped the user's adapter (a memory it holds changed): train a version without it.
        Called on the store's thread before its call returns: only queues (never blocks)."""
        with self._tried_lock:
            self._tried.pop(user_id, None)
        if self.thread.submit(user_id):
            log.info("user %r: adapter stopped by a change; a new version is queued", user_id)

    def sweep(self) -> list[str]:
        """Queue the users whose candidates are not all served by their adapter (bounded). Returns them."""
        if not self.backend.is_ready():
            return []
        queued = []
        for user_id in reversed(self.scheduler.plans.users()):  # the most recently active first
            if len(queued) >= MAX_SUBMITS_PER_SWEEP:
                break
            candidates = frozenset(self.scheduler.distill_candidates(user_id))
            if not candidates:
                continue
            adapter = self.scheduler.served_adapter(user_id)
            # trained into the served adapter, recalled or not: the same facts and seed train the same weights
            if adapter is not None and candidates <= set(adapter.trained_ids):
                continue
            with self._tried_lock:
                if self._tried.get(user_id) == candidates:
                    continue  # tried with exactly these (refused, or nothing selected): wait for a change
            # recorded only once queued: a user whose job is running trains what it read when it started,
            # so candidates that came since are looked at again by the next sweep after it
            if self.thread.submit(user_id):
                self._set_tried(user_id, candidates)
                queued.append(user_id)
        return queued

    def _set_tried(self, user_id: str, candidates: frozenset[str]) -> None:
        with self._tried_lock:
            self._tried.pop(user_id, None)
            self._tried[user_id] = candidates
            while len(self._tried) > MAX_TRIED:
                self._tried.popitem(last=False)

    def _sweep_loop(self) -> None:
        while not self._stop.wait(self.config.distill_interval_s):
            try:
                self.sweep()
            except Exception:  # noqa: BLE001 - the sweep must outlive one bad pass; logged
                log.exception("distillation sweep failed")

    # -- the job (DistillThread's thread) --------------------------------------------------------------------
    def _writer(self) -> Generate | None:
        """The served model writing questions (`--distill-augment model`), or None: templates only."""
        if self.config.distill_augment != "model":
            return None
        if "response_format" not in self.backend.sampling_features:
            log.warning("--distill-augment model: the backend serves no response format; templates only")
            return None
        from serving.background.self_generate import backend_generate

        return backend_generate(self.backend)

    def _load_private_handle(self) -> Any:
        from kvmem.models import load_model

        served = self.backend.handle
        handle = load_model(self.backend.config.model, device=served.device, dtype=served.dtype)
        if handle.fingerprint.digest != served.fingerprint.digest:
            raise RuntimeError(
                "the model loaded for distillation is not the served model (fingerprints differ)"
            )
        return handle

    def _job(self, user_id: str) -> DistillOutcome | None:
        from kvmem.kv.layout import PromptLayout

        # what this job sees; the sweep queues the user again only once they change
        self._set_tried(user_id, frozenset(self.scheduler.distill_candidates(user_id)))
        if self._handle is None:
            self._handle = self._load_handle()
        handle = self._handle
        outcome = distill_user(
            user_id,
            store=self.store,
            registry=self.registry,
            handle=handle,
            layout=PromptLayout(handle.tokenizer, self.backend.layout.system_prompt),
            stats=self.scheduler.heat.stats(user_id),
            now=self.clock(),
            config=self.distill_config,
            generate=self._writer(),
        )
        log.info("distillation of user %r: %s", user_id, outcome.summary())
        return outcome

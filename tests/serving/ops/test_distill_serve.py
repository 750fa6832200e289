"""`kvmem serve --distill` on the tiny llama: the server's own background distillation (serving/background/distill.py
over scheduler.distill.job's DistillThread and job). A change of a memory held by the active adapter stops it
before the call returns and queues a new version without that memory, trained, gated and written by the real
job; the periodic sweep queues a user whose candidates no served adapter holds, once per candidate set, and
never one whose adapter holds them all. The tiny model's adapters fail the recall gate (it learns nothing in 2
steps), so the tests check what was written and that it was not activated; activation itself is the job's
(tests/scheduler/test_distill.py) and is served as tests/serving/backends/test_lora_tier.py shows."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest

peft = pytest.importorskip("peft")

import torch  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from kvmem.adapters import AdapterRegistry, FactRef, text_sha  # noqa: E402
from kvmem.text import HashEmbedder, MemoryStore  # noqa: E402
from scheduler import SchedulerConfig  # noqa: E402
from scheduler.distill.gates import GateConfig  # noqa: E402
from scheduler.distill.job import DistillConfig  # noqa: E402
from scheduler.distill.selection import SelectConfig  # noqa: E402
from scheduler.distill.train import TrainConfig  # noqa: E402
from scheduler.queue import Task  # noqa: E402
from scheduler.wiring import make_scheduler  # noqa: E402
from serving.config import ServingConfig  # noqa: E402
from serving.http.app import create_app  # noqa: E402
from serving.ops.cli import UsageError, build_parser, config_from_args  # noqa: E402
from tests.serving.kvstack import load_backend  # noqa: E402

DOG, PORTO, ACME = "My dog is called Miso.", "I live in Porto.", "I work at Acme."
HOUR = 3600.0
FAST = DistillConfig(
    select=SelectConfig(min_stable_s=HOUR, min_uses=0, max_facts=2),
    train=TrainConfig(max_steps=2, eval_every=1, batch_size=4, replay_tokens=4, answer_tokens=4, top_k=8),
    gates=GateConfig(generic_tokens=4, answer_tokens=4),
)


class Clock:
    def __init__(self) -> None:
        self.now = 2_000_000_000.0  # after the store's own timestamps: memories are old unless heat says not

    def __call__(self) -> float:
        return self.now


@dataclass
class Server:
    client: TestClient
    app: Any
    store: MemoryStore
    clock: Clock
    registry: AdapterRegistry

    def add(self, user: str, text: str) -> str:
        r = self.client.post("/v1/memories", json={"user_id": user, "text": text})
        assert r.status_code == 201, r.text
        return r.json()["memories"][0]["id"]


@contextmanager
def serving(tmp_path, tiny_model_dir) -> Iterator[Server]:
    backend = load_backend(tiny_model_dir, tmp_path)
    store = MemoryStore(tmp_path / "memories.sqlite", embedder=HashEmbedder())
    config = ServingConfig(
        data_dir=tmp_path,
        backend="transformers",
        auth=False,
        store_turns=False,
        distill=True,
        distill_interval_s=24 * HOUR,  # the sweep thread never wakes in a test: sweeps are called
    )
    clock = Clock()
    scheduler = make_scheduler(
        config,
        store,
        backend,
        scheduler_config=SchedulerConfig(distill_min_uses=0, distill_min_stable_s=HOUR),
        clock=clock,
    )
    scheduler.start()
    app = create_app(config, backend=backend, store=store, scheduler=scheduler, distill_config=FAST)
    app.state.distiller.clock = clock
    try:
        with TestClient(app) as client:
            yield Server(client, app, store, clock, AdapterRegistry(tmp_path / "adapters"))
    finally:
        scheduler.stop()
        store.close()
        asyncio.run(backend.aclose())


def test_a_change_stops_the_adapter_and_a_version_without_the_memory_is_trained(
    tmp_path, tiny_model_dir, tiny_handle
):
    with serving(tmp_path, tiny_model_dir) as s:
        distiller = s.app.state.distiller
        dog, porto, acme = s.add("alice", DOG), s.add("alice", PORTO), s.add("alice", ACME)
        s.clock.now += 2 * HOUR  # every memory is now stable for two hours
        torch.manual_seed(0)
        lora = peft.get_peft_model(
            copy.deepcopy(tiny_handle.model),
            peft.LoraConfig(r=2, lora_alpha=4, target_modules="all-linear", init_lora_weights=False),
        )
        fp = s.app.state.backend.handle.fingerprint.digest
        v1 = s.registry.write(
            "alice",
            lambda d: lora.save_pretrained(str(d), safe_serialization=True),
            base_fingerprint=fp,
            facts=(FactRef(dog, 1, text_sha(DOG)), FactRef(porto, 1, text_sha(PORTO))),
            seed=0,
            passed=True,
        )
        s.registry.activate("alice", v1.version, fp)
        plan = s.client.get("/v1/memories/plan", params={"user_id": "alice"}).json()
        assert plan["adapter"]["memory_ids"] == [dog, porto]

        r = s.client.patch(f"/v1/memories/{dog}", json={"user_id": "alice", "text": "My dog is called Rex."})
        assert r.status_code == 200
        assert s.registry.active("alice") is None  # stopped before the call returned
        assert distiller.thread.wait_idle(600)
        outcome = distiller.thread.outcomes["alice"]
        assert outcome is not None and outcome.manifest is not None
        v2 = outcome.manifest
        # a new version, without the changed memory (changed 0 s ago: not stable); the others are
        assert v2.version == 2
        assert {f.memory_id for f in v2.facts} == {porto, acme}
        assert dict(outcome.selection.skipped)[dog] == "changed recently"
        assert [m.version for m in s.registry.versions("alice")] == [2]  # v1 held the old text: erased
        # the tiny model learns nothing in two steps: the gate refuses it, and it is not served
        assert (outcome.activated, v2.passed) == (False, False)
        assert "recalls none" in v2.reason
        assert s.registry.active("alice") is None
        assert s.client.get("/v1/memories/plan", params={"user_id": "alice"}).json()["adapter"] is None


def test_the_sweep_does_not_retrain_an_adapter_for_the_facts_it_did_not_fully_recall(
    tmp_path, tiny_model_dir, tiny_handle
):
    with serving(tmp_path, tiny_model_dir) as s:
        dog, porto = s.add("alice", DOG), s.add("alice", PORTO)
        s.clock.now += 2 * HOUR
        s.app.state.scheduler.queue.put(Task("refresh", "alice"))
        s.app.state.scheduler.flush()
        assert sorted(s.app.state.scheduler.distill_candidates("alice")) == sorted([dog, porto])
        torch.manual_seed(0)
        lora = peft.get_peft_model(
            copy.deepcopy(tiny_handle.model),
            peft.LoraConfig(r=2, lora_alpha=4, target_modules="all-linear", init_lora_weights=False),
        )
        fp = s.app.state.backend.handle.fingerprint.digest
        v1 = s.registry.write(
            "alice",
            lambda d: lora.save_pretrained(str(d), safe_serialization=True),
            base_fingerprint=fp,
            facts=(FactRef(dog, 1, text_sha(DOG)), FactRef(porto, 1, text_sha(PORTO))),
            served_ids=[dog],
            seed=0,
            passed=True,
        )
        s.registry.activate("alice", v1.version, fp)
        # both candidates are in its weights (the same facts and seed would train the same weights): not queued,
        # though Porto is served from the block, not the adapter
        assert s.app.state.distiller.sweep() == []
        assert s.app.state.distiller.thread.idle()
        plan = s.client.get("/v1/memories/plan", params={"user_id": "alice"}).json()["adapter"]
        assert (plan["memory_ids"], plan["trained_ids"]) == ([dog], [dog, porto])


@pytest.mark.slow
def test_the_sweep_queues_users_whose_candidates_no_adapter_holds_once(tmp_path, tiny_model_dir):
    with serving(tmp_path, tiny_model_dir) as s:
        distiller = s.app.state.distiller
        porto, acme = s.add("alice", PORTO), s.add("alice", ACME)
        s.add("carol", DOG)
        s.app.state.scheduler.flush()
        assert distiller.sweep() == []  # nothing is stable yet (heat saw them added now)
        s.clock.now += 2 * HOUR
        for user in ("alice", "carol"):  # a refresh recomputes the candidates (as any request's access does)
            s.app.state.scheduler.queue.put(Task("refresh", user))
        s.app.state.scheduler.flush()
        assert sorted(s.app.state.scheduler.distill_candidates("alice")) == sorted([porto, acme])
        assert sorted(distiller.sweep()) == ["alice", "carol"]
        assert distiller.thread.wait_idle(600)
        assert distiller.sweep() == []  # tried with exactly these candidates: not again until they change
        written = distiller.thread.outcomes["alice"].manifest
        assert {f.memory_id for f in written.facts} == {porto, acme}
        assert [m.version for m in s.registry.versions("alice")] == [1]
        assert s.registry.active("alice") is None  # refused by the gates (tiny model)


def test_serve_distill_flags_become_the_config(tmp_path):
    args = build_parser().parse_args(
        ["serve", "--data-dir", str(tmp_path), "--distill", "--distill-interval-s", "30"]
    )
    config = config_from_args(args)
    assert (config.distill, config.distill_interval_s) == (True, 30.0)
    default = config_from_args(build_parser().parse_args(["serve", "--data-dir", str(tmp_path)]))
    assert (default.distill, default.distill_interval_s, default.enable_lora) == (False, 600.0, False)
    vllm = ["serve", "--data-dir", str(tmp_path), "--backend", "vllm", "--distill", "--enable-lora"]
    assert config_from_args(build_parser().parse_args(vllm)).enable_lora
    for argv, message in [
        (["--distill", "--backend", "fake"], "needs a model"),
        (["--distill", "--backend", "vllm"], "needs --enable-lora"),
        (["--distill-interval-s", "0"], "distill_interval_s must be > 0"),
    ]:
        with pytest.raises(UsageError, match=message):
            config_from_args(build_parser().parse_args(["serve", "--data-dir", str(tmp_path), *argv]))

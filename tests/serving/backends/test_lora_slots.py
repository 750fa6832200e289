"""The transformers backend's adapter slots (serving/backends/transformers/adapters.py) on the tiny llama: a version the delete
cascade erased leaves the slots at once and its weights leave the model, but not under a request still
running it: its weights go when that request ends. Through the server: tests/serving/backends/test_lora_tier.py."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest

peft = pytest.importorskip("peft")

from kvmem.adapters import FactRef, text_sha  # noqa: E402
from serving.backends.transformers.adapters import AdapterSlots  # noqa: E402
from tests.serving.lora_helpers import DOG, random_lora, write_active  # noqa: E402


def two_users_slots(tmp_path, tiny_handle):
    """(registry, alice's active version, bob's, slots over a copy of the tiny llama): two random LoRAs."""
    fp = tiny_handle.fingerprint.digest
    reg, m = write_active(
        tmp_path, "alice", random_lora(tiny_handle, 5), [FactRef("m1", 1, text_sha(DOG))], fp
    )
    _, other = write_active(
        tmp_path, "bob", random_lora(tiny_handle, 6), [FactRef("m2", 1, text_sha(DOG))], fp
    )
    handle = SimpleNamespace(model=copy.deepcopy(tiny_handle.model), fingerprint=tiny_handle.fingerprint)
    return reg, m, other, AdapterSlots(reg, handle)


def test_an_erased_version_is_unloaded_once_no_request_runs_it(tmp_path, tiny_handle):
    reg, m, other, slots = two_users_slots(tmp_path, tiny_handle)
    name, why = slots.resolve("alice", m.adapter_id)
    bob, _ = slots.resolve("bob", other.adapter_id)
    assert why is None and slots.loaded == (name, bob)

    def running() -> list[str]:  # a request under alice's adapter is running when the cascade erases it
        assert reg.erase("alice", [m.version], "memory m1 deleted") == [m]
        assert slots.forget([m.name]) is True
        assert slots.loaded == (bob,)  # at once: no longer a slot
        assert slots.purge() == []  # its weights stay while the request runs them
        return sorted(slots._peft.peft_config)

    assert slots.run(name, running) == sorted([name, bob])
    assert sorted(slots._peft.peft_config) == [bob]  # deleted when the request ended
    assert slots.served == {bob: other.name}
    assert slots.forget([m.name]) is False and slots.purge() == []  # idempotent
    gone, why = slots.resolve("alice", m.adapter_id)
    assert gone is None and "unusable" in why  # erased: never loaded again
    # bob's version, not running anything, goes at the next purge: the model holds no adapter weights
    assert slots.forget([other.name]) is True and slots.purge() == [bob]
    assert slots.loaded == () and sorted(slots._peft.peft_config) == []
    # and a new version loads into the emptied peft model
    _, v2 = write_active(
        tmp_path,
        "alice",
        random_lora(tiny_handle, 7),
        [FactRef("m3", 1, text_sha(DOG))],
        tiny_handle.fingerprint.digest,
    )
    fresh, why = slots.resolve("alice", v2.adapter_id)
    assert why is None and slots.loaded == (fresh,) and sorted(slots._peft.peft_config) == [fresh]


def test_prefetched_weights_are_attached_without_a_read_and_an_erased_versions_are_dropped(
    tmp_path, tiny_handle
):
    """`prefetch` (an I/O thread) reads and hashes a version's weights; `resolve` (the model thread) then
    attaches them without reading them again. A version erased after its prefetch is dropped by `forget` and
    refused by `resolve`, which reads the manifest in any case."""
    reg, m, other, slots = two_users_slots(tmp_path, tiny_handle)
    reads: list[str] = []
    real_load = reg.load
    reg.load = lambda manifest, digest=None: reads.append(manifest.name) or real_load(manifest, digest)
    slots.prefetch("alice", m.adapter_id)
    slots.prefetch("alice", m.adapter_id)  # read once
    assert reads == [m.name]
    name, why = slots.resolve("alice", m.adapter_id)
    assert why is None and slots.loaded == (name,) and reads == [m.name]  # attached, not read again
    slots.prefetch("alice", m.adapter_id)  # loaded: nothing read
    assert reads == [m.name]
    slots.prefetch("alice", "alice/v99")  # unusable: nothing read, resolve says why
    assert reads == [m.name] and slots.resolve("alice", "alice/v99")[0] is None

    slots.prefetch("bob", other.adapter_id)
    assert reads == [m.name, other.name]
    assert reg.erase("bob", [other.version], "memory m2 deleted") == [other]
    assert slots.forget([other.name]) is False  # never attached: nothing to purge, its read weights dropped
    assert slots._read == {}
    gone, why = slots.resolve("bob", other.adapter_id)
    assert gone is None and "unusable" in why and reads == [m.name, other.name]


def test_a_version_erased_while_it_is_being_attached_is_never_loaded(tmp_path, tiny_handle):
    """The delete cascade runs on its own thread: it can erase a version after `resolve` (the model thread)
    read its manifest and before the weights are attached, when `forget` finds nothing loaded to drop. `resolve`
    then refuses it, it is not loaded, and its weights leave the model (a CI run saw an erased version loaded
    after the call that erased it had returned)."""
    reg, m, other, slots = two_users_slots(tmp_path, tiny_handle)
    real_load = reg.load

    def load_while_erased(manifest, digest=None):
        loaded = real_load(manifest, digest)
        assert reg.erase("alice", [m.version], "memory m1 superseded") == [m]
        assert slots.forget([m.name]) is False  # not loaded yet: nothing for the cascade to drop
        return loaded

    reg.load = load_while_erased
    name, why = slots.resolve("alice", m.adapter_id)
    assert name is None and "erased while it was being attached" in why
    assert slots.loaded == () and sorted(slots._peft.peft_config) == [] and slots.served == {}

    def load_while_another_erased(manifest, digest=None):
        assert slots.forget([m.name]) is False  # a cascade meanwhile, of another version than this one
        return real_load(manifest, digest)

    reg.load = load_while_another_erased
    bob, why = slots.resolve("bob", other.adapter_id)
    assert why is None and slots.loaded == (bob,)


def test_an_adapter_the_engine_cannot_run_is_refused_and_its_weights_leave_the_model(
    tmp_path, tiny_handle, monkeypatch
):
    """Every request runs in the engine (one decode path), so an adapter on layers its batched LoRA cannot
    run (true convolutions: `serving/engine/lora.py` `supports`, tested in tests/serving/engine/test_engine.py) is
    refused when it is attached, with the reason, and its weights leave the model; others still load."""
    from serving.engine import lora

    reg, m, other, slots = two_users_slots(tmp_path, tiny_handle)
    runs = lora.supports
    monkeypatch.setattr(lora, "supports", lambda model, name: False)
    name, why = slots.resolve("alice", m.adapter_id)
    assert name is None and "layers the engine cannot run an adapter on" in why
    assert slots.loaded == () and sorted(slots._peft.peft_config) == []
    monkeypatch.setattr(lora, "supports", runs)
    bob, why = slots.resolve("bob", other.adapter_id)
    assert why is None and slots.loaded == (bob,) and sorted(slots._peft.peft_config) == [bob]

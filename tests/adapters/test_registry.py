"""The adapter registry on the tiny llama with real peft adapters: immutable versions, the active pointer and
rollback, isolation between users, the delete cascade, and corrupt or mismatched files never served."""

from __future__ import annotations

import copy
import json

import pytest

peft = pytest.importorskip("peft")

import torch  # noqa: E402

from kvmem.adapters import (  # noqa: E402
    AdapterCorrupt,
    AdapterMismatch,
    AdapterRegistry,
    FactRef,
)
from kvmem.adapters.manifest import MANIFEST_FILE, WEIGHTS_FILE  # noqa: E402

FACTS = (FactRef("m1", 1, "aaaa"), FactRef("m2", 3, "bbbb"))


def _peft(model, seed: int):
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    return peft.get_peft_model(copy.deepcopy(model), config).eval()


def _write(registry, user, model, *, seed=0, passed=True, facts=FACTS, fingerprint="fp-1"):
    return registry.write(
        user,
        lambda d: model.save_pretrained(str(d), safe_serialization=True),
        base_fingerprint=fingerprint,
        facts=facts,
        seed=seed,
        passed=passed,
        reason="" if passed else "recall 0.10 < 0.90 x 1.00",
        gates={"recall_adapter": 1.0},
    )


@pytest.fixture(scope="module")
def tuned(tiny_handle):
    return _peft(tiny_handle.model, 1), _peft(tiny_handle.model, 2)


def test_versions_are_immutable_and_the_pointer_rolls_back(tmp_path, tuned):
    reg = AdapterRegistry(tmp_path)
    a = _write(reg, "alice", tuned[0], seed=11)
    b = _write(reg, "alice", tuned[1], seed=12)
    assert (a.version, b.version) == (1, 2)
    assert a.sha256 != b.sha256
    assert a.name == f"{a.adapter_id}@v1-{a.sha256[:16]}"
    on_disk = json.loads((reg.path_of(a) / MANIFEST_FILE).read_text())
    assert (on_disk["version"], on_disk["sha256"], on_disk["seed"]) == (1, a.sha256, 11)  # vLLM reads these
    assert on_disk["facts"] == [
        {"memory_id": "m1", "version": 1, "text_sha": "aaaa"},
        {"memory_id": "m2", "version": 3, "text_sha": "bbbb"},
    ]
    assert sorted(p.name for p in reg.path_of(a).iterdir()) == sorted(
        ["README.md", "adapter_config.json", WEIGHTS_FILE, MANIFEST_FILE]
    )
    assert reg.active("alice") is None
    reg.activate("alice", 1, "fp-1")
    reg.activate("alice", 2, "fp-1")
    assert reg.active("alice").version == 2
    assert reg.rollback("alice", "fp-1").version == 1
    assert reg.active("alice").version == 1
    assert reg.rollback("alice", "fp-1") is None  # nothing earlier
    assert reg.active("alice") is None
    assert [m.version for m in reg.versions("alice")] == [1, 2]  # rollback deletes nothing


def test_a_loaded_adapter_computes_what_the_trained_one_did(tmp_path, tiny_handle, tuned):
    reg = AdapterRegistry(tmp_path)
    m = _write(reg, "alice", tuned[0])
    loaded = reg.load(m, "fp-1")
    config = peft.LoraConfig(
        **{k: v for k, v in loaded.config.items() if k in ("r", "lora_alpha", "target_modules")}
    )
    fresh = peft.get_peft_model(copy.deepcopy(tiny_handle.model), config).eval()
    result = peft.set_peft_model_state_dict(fresh, loaded.state)
    assert not [k for k in result.missing_keys if "lora_" in k] and not result.unexpected_keys
    ids = torch.tensor([[5, 17, 230, 9, 41]])
    with torch.inference_mode():
        assert torch.equal(fresh(input_ids=ids).logits, tuned[0](input_ids=ids).logits)
        with fresh.disable_adapter():
            base = fresh(input_ids=ids).logits
        assert not torch.equal(base, tuned[0](input_ids=ids).logits)


def test_users_are_isolated(tmp_path, tuned):
    reg = AdapterRegistry(tmp_path)
    a = _write(reg, "alice", tuned[0])
    b = _write(reg, "../bob", tuned[1])  # a user id that looks like a path stays under the registry
    assert reg.path_of(b).resolve().is_relative_to(tmp_path.resolve())
    assert reg.path_of(a) != reg.path_of(b)
    reg.activate("alice", 1)
    assert reg.active("../bob") is None
    assert reg.versions("carol") == []
    reg.activate("../bob", 1)
    assert reg.deactivate_covering("alice", ["m2"], "memory m2 deleted")
    assert reg.active("alice") is None and reg.active("../bob").sha256 == b.sha256
    # a pointer file copied into another user's directory is not taken as theirs
    (reg.user_dir("carol")).mkdir()
    (reg.user_dir("carol") / "active.json").write_bytes((reg.user_dir("../bob") / "active.json").read_bytes())
    assert reg.active("carol") is None


def test_the_delete_cascade_only_stops_adapters_holding_the_memory(tmp_path, tuned):
    reg = AdapterRegistry(tmp_path)
    _write(reg, "alice", tuned[0])
    reg.activate("alice", 1)
    assert not reg.deactivate_covering("alice", ["m9"], "memory m9 deleted")
    assert reg.active("alice").version == 1
    assert reg.deactivate_covering("alice", ["m9", "m1"], "memory m1 changed")
    assert reg.active("alice") is None
    assert (
        reg.rollback("alice").version == 1
    )  # an operator may bring it back; the cascade never deletes files


def test_erase_deletes_the_files_leaves_no_rollback_to_them_and_never_reuses_their_numbers(tmp_path, tuned):
    reg = AdapterRegistry(tmp_path)
    other = (FactRef("m3", 1, "cccc"),)
    for model, facts in ((tuned[0], FACTS), (tuned[1], other), (tuned[1], FACTS)):
        reg.activate("alice", _write(reg, "alice", model, facts=facts).version, "fp-1")
    _write(reg, "bob", tuned[0])
    assert reg.active("alice").version == 3  # history [1, 2]
    gone = reg.erase("alice", [1, 3], "memory m1 deleted")
    assert sorted(m.version for m in gone) == [1, 3]
    assert [m.version for m in reg.versions("alice")] == [2]
    assert sorted(p.name for p in reg.user_dir("alice").iterdir()) == [
        "active.json",
        "v0002",
    ]  # no trash left
    assert reg.active("alice") is None  # it named an erased version
    assert json.loads((reg.user_dir("alice") / "active.json").read_text())["reason"] == "memory m1 deleted"
    assert reg.rollback("alice", "fp-1").version == 2  # v1 left the history with its files
    assert reg.rollback("alice", "fp-1") is None
    assert _write(reg, "alice", tuned[0]).version == 4  # v3's number is never given again
    assert reg.erase("alice", [], "nothing") == []
    assert [m.version for m in reg.versions("bob")] == [1]  # another user's versions are untouched


def test_the_cascade_erases_versions_holding_a_stale_memory_and_keeps_one_on_its_new_text(tmp_path, tuned):
    from kvmem.adapters.active import ActiveAdapters

    reg = AdapterRegistry(tmp_path)
    _write(reg, "alice", tuned[0], facts=(FactRef("m1", 1, "aaaa"), FactRef("m2", 1, "cccc")))
    _write(reg, "alice", tuned[1], facts=(FactRef("m1", 2, "bbbb"),))  # trained after m1 changed
    _write(reg, "alice", tuned[1], facts=(FactRef("m2", 1, "cccc"),))
    texts = {"m1": "bbbb", "m2": "cccc"}  # the store now

    def facts_current(user_id, facts):
        stale = [f.memory_id for f in facts if texts[f.memory_id] != f.text_sha]
        return f"memory {stale[0]} changed" if stale else None

    active = ActiveAdapters(reg, lambda: "fp-1", facts_current)
    assert [m.version for m in active.erase_stale("alice", ["m1"], "memory m1 updated")] == [1]
    assert [m.version for m in reg.versions("alice")] == [2, 3]
    assert active.erase_stale("alice", ["m9"], "memory m9 deleted") == []
    assert [m.version for m in active.erase_stale("alice", None, "every memory deleted")] == [2, 3]
    assert reg.versions("alice") == []


def test_corrupt_or_mismatched_adapters_are_never_served(tmp_path, tuned):
    reg = AdapterRegistry(tmp_path)
    m = _write(reg, "alice", tuned[0])
    reg.activate("alice", 1, "fp-1")
    weights = reg.path_of(m) / WEIGHTS_FILE
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # one flipped bit in a tensor
    weights.write_bytes(bytes(data))
    assert "adapter_model.safetensors hash mismatch" in reg.verify(m)
    with pytest.raises(AdapterCorrupt, match="fails its hash"):
        reg.load(m)
    with pytest.raises(AdapterCorrupt, match="hash mismatch"):
        reg.activate("alice", 1)
    good = _write(reg, "alice", tuned[1])
    with pytest.raises(AdapterMismatch, match="another base model"):
        reg.load(good, "fp-2")
    assert "trained on base model fp-1" in reg.verify(good, "fp-2")
    refused = _write(reg, "alice", tuned[1], passed=False)
    with pytest.raises(AdapterCorrupt, match="refused by its gates: recall 0.10"):
        reg.activate("alice", refused.version)
    (reg.path_of(good) / MANIFEST_FILE).write_text("{not json")
    assert [v.version for v in reg.versions("alice")] == [1, 3]  # the unreadable manifest is skipped
    assert _write(reg, "alice", tuned[1]).version == 4
    reg.activate("alice", 4)  # the history holds v1, now corrupt
    # rollback skips the corrupt v1 and leaves nothing served
    assert reg.rollback("alice") is None


def test_a_save_that_writes_pickle_is_refused_and_leaves_nothing(tmp_path, tuned):
    reg = AdapterRegistry(tmp_path)

    def pickled(d):
        tuned[0].save_pretrained(str(d), safe_serialization=True)
        (d / "adapter_model.bin").write_bytes(b"\x80\x04")

    with pytest.raises(AdapterCorrupt, match="pickle"):
        reg.write("alice", pickled, base_fingerprint="fp", facts=FACTS, seed=0, passed=True)
    assert reg.versions("alice") == [] and list(reg.user_dir("alice").iterdir()) == []


def test_served_ids_round_trip_default_to_every_fact_and_must_be_trained_facts(tmp_path, tuned):
    reg = AdapterRegistry(tmp_path)
    save = lambda d: tuned[0].save_pretrained(str(d), safe_serialization=True)  # noqa: E731
    part = reg.write(
        "alice", save, base_fingerprint="fp", facts=FACTS, seed=0, passed=True, served_ids=["m2"]
    )
    assert (part.memory_ids, part.served_memory_ids) == (("m1", "m2"), ("m2",))
    on_disk = json.loads((reg.path_of(part) / MANIFEST_FILE).read_text())
    assert on_disk["served_ids"] == ["m2"] and reg.manifest("alice", 1) == part
    every = _write(reg, "alice", tuned[1])  # no served_ids: served for all of its facts
    assert every.served_ids is None and every.served_memory_ids == ("m1", "m2")
    # a manifest written before served_ids existed reads as serving every fact
    path = reg.path_of(every) / MANIFEST_FILE
    old = json.loads(path.read_text())
    del old["served_ids"]
    path.write_text(json.dumps(old))
    assert reg.manifest("alice", 2).served_memory_ids == ("m1", "m2")
    with pytest.raises(AdapterCorrupt, match="serves memories it was not trained on"):
        reg.write("alice", save, base_fingerprint="fp", facts=FACTS, seed=0, passed=True, served_ids=["m9"])
    assert [m.version for m in reg.versions("alice")] == [1, 2]  # nothing left behind by the refused write
    assert [p.name for p in reg.user_dir("alice").iterdir() if p.name.startswith(".tmp")] == []
    # a manifest edited on disk to serve a memory it does not hold is corrupt: never read, never served
    on_disk["served_ids"] = ["m1", "m9"]
    (reg.path_of(part) / MANIFEST_FILE).write_text(json.dumps(on_disk))
    with pytest.raises(AdapterCorrupt, match="serves memories it was not trained on"):
        reg.manifest("alice", 1)
    with pytest.raises(AdapterCorrupt):
        reg.activate("alice", 1, "fp")

"""The vLLM backend's pure parts, without an engine: the cache salt, adapter names, the connector's load plan
and its hand-off shelf."""

from __future__ import annotations

import hashlib
import json
import logging
from types import SimpleNamespace

import pytest
import torch

from serving.backends.vllm.request import (
    MAX_HASHED_FILES,
    MAX_LORA_NAMES,
    AdapterRef,
    FileHashes,
    LoraIds,
    adapter_ref,
    cache_salt,
)


def test_the_salt_names_the_user_and_the_block_item_and_nothing_else():
    salts = {
        cache_salt("alice", "item-1"),
        cache_salt("alice", "item-2"),
        cache_salt("bob", "item-1"),
        cache_salt("alice", None),
        cache_salt("bob", None),
        cache_salt("alice\x00item-1", None),  # no user id can forge another pair's salt
    }
    assert len(salts) == 6
    assert cache_salt("alice", "item-1") == cache_salt("alice", "item-1")
    assert all(len(s) == 32 and int(s, 16) >= 0 for s in salts)


def _adapter(directory, version, weights=b"weights-1", config=b'{"r": 8}', with_config=True):
    """peft-like files and the manifest the parametric tier's registry writes beside them."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "adapter_model.safetensors").write_bytes(weights)
    (directory / "adapter_config.json").write_bytes(config)
    manifest = {"version": version, "sha256": hashlib.sha256(weights).hexdigest()}
    if with_config:
        manifest["config_sha256"] = hashlib.sha256(config).hexdigest()
    (directory / "kvmem_adapter.json").write_text(json.dumps(manifest))
    return manifest["sha256"]


def test_an_adapter_is_named_by_its_version_and_hash(tmp_path):
    ids = LoraIds()
    sha = _adapter(tmp_path / "ad-1", 3)
    ref = adapter_ref(tmp_path, "ad-1", ids)
    assert ref == AdapterRef(name=f"ad-1@v3-{sha[:16]}", int_id=1, path=str(tmp_path / "ad-1"))
    assert adapter_ref(tmp_path, "ad-1", ids) == ref  # the same adapter: the same name and id
    sha2 = _adapter(tmp_path / "ad-1", 4, weights=b"weights-2")
    assert sha2 != sha
    # a new version with new weights is a new adapter to vLLM: a new name and a new id
    assert adapter_ref(tmp_path, "ad-1", ids) == AdapterRef(f"ad-1@v4-{sha2[:16]}", 2, str(tmp_path / "ad-1"))
    _adapter(tmp_path / "ad-2", 1, with_config=False)  # config_sha256 is optional
    assert adapter_ref(tmp_path, "ad-2", ids).int_id == 3
    assert adapter_ref(tmp_path, "missing", ids) is None
    (tmp_path / "ad-1" / "kvmem_adapter.json").write_text("{not json")
    assert adapter_ref(tmp_path, "ad-1", ids) is None


@pytest.mark.parametrize("part", ["adapter_model.safetensors", "adapter_config.json"])
def test_an_adapter_whose_files_are_not_its_manifests_is_not_served(tmp_path, part, caplog):
    # weights (or config) replaced under an old manifest would be served under the old name: refused instead
    ids = LoraIds()
    _adapter(tmp_path / "ad-1", 1)
    good = adapter_ref(tmp_path, "ad-1", ids)
    path = tmp_path / "ad-1" / part
    path.write_bytes(path.read_bytes() + b" ")
    with caplog.at_level(logging.WARNING, logger="serving.backends.vllm.request"):
        assert adapter_ref(tmp_path, "ad-1", ids) is None
    assert any("do not match its manifest" in r.getMessage() for r in caplog.records)
    path.unlink()
    assert adapter_ref(tmp_path, "ad-1", ids) is None
    assert good is not None and good.int_id == 1


def test_lora_ids_are_one_per_name_and_never_shared():
    ids = LoraIds()
    names = [f"u{k}/v0001@v1-{k:016x}" for k in range(2000)]
    got = [ids.of(n) for n in names]
    assert got == list(range(1, 2001)) and [ids.of(n) for n in names] == got


def test_lora_ids_are_bounded_and_a_forgotten_name_gets_a_new_id_never_an_old_one():
    """Issue 27 item 6: the name -> id map keeps at most max_names (LRU); a name asked for again past the bound
    gets the next id (vLLM loads it again), never one another name had."""
    assert (LoraIds().max_names, FileHashes().max_files) == (MAX_LORA_NAMES, MAX_HASHED_FILES) == (4096, 4096)
    ids = LoraIds(max_names=3)
    assert [ids.of(n) for n in ("a", "b", "c")] == [1, 2, 3]
    assert ids.of("a") == 1  # read again: now the most recent
    assert ids.of("d") == 4 and len(ids) == 3  # "b", the least recent, is forgotten
    assert list(ids._ids) == ["c", "a", "d"]
    assert ids.of("b") == 5  # forgotten: a new id, not 2
    many = LoraIds(max_names=100)
    got = [many.of(f"u{k}/v0001@v1-{k:016x}") for k in range(100_000)]
    assert got == list(range(1, 100_001)) and len(many) == 100
    with pytest.raises(ValueError, match="LoraIds.max_names must be >= 1, got 0"):
        LoraIds(max_names=0)


def test_file_hashes_are_bounded_and_rehash_a_changed_or_forgotten_file(tmp_path, monkeypatch):
    hashes = FileHashes(max_files=2)
    paths = [tmp_path / f"f{k}" for k in range(3)]
    for k, path in enumerate(paths):
        path.write_bytes(b"x" * k)
    reads: list[str] = []
    real_open = open
    monkeypatch.setattr("builtins.open", lambda p, *a, **kw: reads.append(str(p)) or real_open(p, *a, **kw))
    assert [hashes.sha256(p) for p in paths] == [hashlib.sha256(b"x" * k).hexdigest() for k in range(3)]
    assert len(hashes) == 2 and list(hashes._hashes) == [str(paths[1]), str(paths[2])]
    reads.clear()
    hashes.sha256(paths[2])  # remembered, unchanged: not read
    assert reads == []
    hashes.sha256(paths[0])  # forgotten: read again
    paths[2].write_bytes(b"changed")  # changed (size): read again
    assert hashes.sha256(paths[2]) == hashlib.sha256(b"changed").hexdigest()
    assert reads == [str(paths[0]), str(paths[2])]
    with pytest.raises(ValueError, match="FileHashes.max_files must be >= 1, got 0"):
        FileHashes(max_files=0)


def test_the_load_plan_puts_each_token_in_its_block_and_offset():
    connector = pytest.importorskip("serving.backends.vllm.connector")
    spec = connector.plan_load("r", "item", 3, 9, block_ids=[7, 2, 5], block_size=4)
    # tokens 3..8: block 7 offset 3, block 2 offsets 0-3, block 5 offset 0
    assert spec.slots == (7 * 4 + 3, 2 * 4, 2 * 4 + 1, 2 * 4 + 2, 2 * 4 + 3, 5 * 4)
    assert spec.block_ids == (7, 2, 5) and (spec.start, spec.end) == (3, 9)
    assert connector.plan_load("r", "item", 4, 8, [7, 2, 5], 4).block_ids == (2,)


def test_a_request_asks_for_at_most_all_but_its_last_prompt_token():
    connector = pytest.importorskip("serving.backends.vllm.connector")

    def request(params, num_prompt_tokens=10):
        return SimpleNamespace(kv_transfer_params=params, num_prompt_tokens=num_prompt_tokens)

    assert connector.requested_tokens(request(connector.transfer_params("it", 6))) == ("it", 6)
    assert connector.requested_tokens(request(connector.transfer_params("it", 10))) == ("it", 9)
    assert connector.requested_tokens(request(None)) is None
    assert connector.requested_tokens(request({"kvmem_item_id": "it", "kvmem_num_tokens": "6"})) is None
    assert connector.requested_tokens(request({"kvmem_item_id": "it", "kvmem_num_tokens": 0})) is None


def test_the_shelf_keeps_an_item_while_any_request_holds_it():
    connector = pytest.importorskip("serving.backends.vllm.connector")
    shelf = connector.ItemShelf()
    item = SimpleNamespace(item_id="it", kv=torch.zeros(1))
    shelf.lend(item)
    shelf.lend(item)
    shelf.take_back("it")
    assert shelf.get("it") is item and len(shelf) == 1
    shelf.take_back("it")
    assert shelf.get("it") is None and len(shelf) == 0

"""The vLLM backend's pure parts, without an engine: the cache salt, adapter names, the connector's load plan
and its hand-off shelf."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from serving.backends.vllm_request import AdapterRef, adapter_ref, cache_salt


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


def test_an_adapter_is_named_by_its_version_and_hash(tmp_path):
    directory = tmp_path / "ad-1"
    directory.mkdir()
    (directory / "kvmem_adapter.json").write_text(json.dumps({"version": 3, "sha256": "ab" * 32}))
    ref = adapter_ref(tmp_path, "ad-1")
    assert ref == AdapterRef(name="ad-1@v3-" + "ab" * 8, int_id=ref.int_id, path=str(directory))
    assert 0 < ref.int_id < 2**31
    (directory / "kvmem_adapter.json").write_text(json.dumps({"version": 4, "sha256": "ab" * 32}))
    assert adapter_ref(tmp_path, "ad-1").name == "ad-1@v4-" + "ab" * 8  # a new version is a new adapter
    assert adapter_ref(tmp_path, "missing") is None
    (directory / "kvmem_adapter.json").write_text("{not json")
    assert adapter_ref(tmp_path, "ad-1") is None


def test_the_load_plan_puts_each_token_in_its_block_and_offset():
    connector = pytest.importorskip("serving.backends.vllm_connector")
    spec = connector.plan_load("r", "item", 3, 9, block_ids=[7, 2, 5], block_size=4)
    # tokens 3..8: block 7 offset 3, block 2 offsets 0-3, block 5 offset 0
    assert spec.slots == (7 * 4 + 3, 2 * 4, 2 * 4 + 1, 2 * 4 + 2, 2 * 4 + 3, 5 * 4)
    assert spec.block_ids == (7, 2, 5) and (spec.start, spec.end) == (3, 9)
    assert connector.plan_load("r", "item", 4, 8, [7, 2, 5], 4).block_ids == (2,)


def test_a_request_asks_for_at_most_all_but_its_last_prompt_token():
    connector = pytest.importorskip("serving.backends.vllm_connector")

    def request(params, num_prompt_tokens=10):
        return SimpleNamespace(kv_transfer_params=params, num_prompt_tokens=num_prompt_tokens)

    assert connector.requested_tokens(request(connector.transfer_params("it", 6))) == ("it", 6)
    assert connector.requested_tokens(request(connector.transfer_params("it", 10))) == ("it", 9)
    assert connector.requested_tokens(request(None)) is None
    assert connector.requested_tokens(request({"kvmem_item_id": "it", "kvmem_num_tokens": "6"})) is None
    assert connector.requested_tokens(request({"kvmem_item_id": "it", "kvmem_num_tokens": 0})) is None


def test_the_shelf_keeps_an_item_while_any_request_holds_it():
    connector = pytest.importorskip("serving.backends.vllm_connector")
    shelf = connector.ItemShelf()
    item = SimpleNamespace(item_id="it", kv=torch.zeros(1))
    shelf.lend(item)
    shelf.lend(item)
    shelf.take_back("it")
    assert shelf.get("it") is item and len(shelf) == 1
    shelf.take_back("it")
    assert shelf.get("it") is None and len(shelf) == 0

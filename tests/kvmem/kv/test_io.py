"""Safe formats (invariant 7) and binding (invariant 3): round trip, corruption on disk, fingerprint
mismatch, disk full mid-write, unwritable directory. Every failure is a specific error, and what was
already stored is untouched."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from kvmem.errors import FingerprintMismatch, InvalidBlock, KVItemCorrupt, KVItemNotFound, StorageError
from kvmem.kv import PromptLayout, build_item
from kvmem.kv.io import item_paths, load_item, save_item, verify_item


@pytest.fixture()
def item(tiny_handle):
    ids = PromptLayout(tiny_handle.tokenizer).block_ids(["I have a cat named Miso.", "I live in Lisbon."])
    return build_item(tiny_handle, ids, user_id="alice", memory_ids=["m1", "m2"])


def test_round_trip_is_bit_identical(tmp_path, item, tiny_handle):
    save_item(item, tmp_path)
    loaded = load_item(tmp_path, item.item_id, tiny_handle.fingerprint)
    assert torch.equal(loaded.kv, item.kv) and loaded.kv.dtype == item.kv.dtype
    assert loaded.token_ids == item.token_ids
    assert loaded.meta == item.meta
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"{item.item_id}.json",
        f"{item.item_id}.safetensors",
    ]
    # no pickle: the tensor file is safetensors (8-byte header length, then a JSON header)
    raw = (tmp_path / f"{item.item_id}.safetensors").read_bytes()
    header_len = int.from_bytes(raw[:8], "little")
    assert json.loads(raw[8 : 8 + header_len])["__metadata__"]["item_id"] == item.item_id


def test_a_paced_write_is_the_same_file_and_its_manifest_names_its_bytes(tmp_path, item, tiny_handle):
    """The server's store writes items in synced pieces with pauses (KVStoreConfig.write_duty): the same
    bytes as a write at once, and the manifest's SHA-256 (taken as it wrote) is the file's."""
    from kvmem.checksum import file_sha256
    from kvmem.kv import KVStoreConfig, TieredKVStore

    whole, paced = tmp_path / "whole", tmp_path / "paced"
    save_item(item, whole)
    store = TieredKVStore(KVStoreConfig(directory=str(paced), write_duty=0.5), tiny_handle.fingerprint)
    store.put(item)
    name = f"{item.item_id}.safetensors"
    assert (paced / name).read_bytes() == (whole / name).read_bytes()
    manifest = json.loads((paced / f"{item.item_id}.json").read_text())
    assert manifest["file_sha256"] == file_sha256(paced / name)
    assert torch.equal(load_item(paced, item.item_id, tiny_handle.fingerprint).kv, item.kv)
    with pytest.raises(ValueError, match="write_duty must be in"):
        KVStoreConfig(directory=str(paced), write_duty=0)


def _flip_byte(path, offset_from_end=100):
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage, error",
    [
        ("flip_tensor_byte", KVItemCorrupt),
        ("truncate_tensor", KVItemCorrupt),
        ("delete_tensor", KVItemCorrupt),
        ("garbage_manifest", KVItemCorrupt),
        ("truncate_manifest", KVItemCorrupt),
        ("delete_manifest", KVItemNotFound),
    ],
)
def test_corruption_raises_specific_error(tmp_path, item, tiny_handle, damage, error):
    save_item(item, tmp_path)
    tensor_path, manifest_path = item_paths(tmp_path, item.item_id)
    if damage == "flip_tensor_byte":
        _flip_byte(tensor_path)
    elif damage == "truncate_tensor":
        tensor_path.write_bytes(tensor_path.read_bytes()[: tensor_path.stat().st_size // 2])
    elif damage == "delete_tensor":
        tensor_path.unlink()
    elif damage == "garbage_manifest":
        manifest_path.write_text("{not json")
    elif damage == "truncate_manifest":
        manifest_path.write_text(manifest_path.read_text()[:40])
    elif damage == "delete_manifest":
        manifest_path.unlink()
    with pytest.raises(error):
        load_item(tmp_path, item.item_id, tiny_handle.fingerprint)
    with pytest.raises(error):  # the verification without a load (resumable builds) sees the same damage
        verify_item(tmp_path, item.item_id, tiny_handle.fingerprint)


def test_verify_item_checks_what_load_item_checks(tmp_path, item, tiny_handle):
    save_item(item, tmp_path)
    assert verify_item(tmp_path, item.item_id, tiny_handle.fingerprint) == item.meta
    other = dataclasses.replace(tiny_handle.fingerprint, weights_sha="something-else")
    with pytest.raises(FingerprintMismatch):
        verify_item(tmp_path, item.item_id, other)
    _, manifest_path = item_paths(tmp_path, item.item_id)
    manifest = json.loads(manifest_path.read_text())
    manifest["meta"]["num_tokens"] += 1  # the shape check: the file holds one token fewer
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(KVItemCorrupt, match="shaped"):
        verify_item(tmp_path, item.item_id, tiny_handle.fingerprint)


def test_corrupt_tensor_with_matching_size_caught_even_without_checksum(tmp_path, item, tiny_handle):
    save_item(item, tmp_path)
    tensor_path, _ = item_paths(tmp_path, item.item_id)
    data = bytearray(tensor_path.read_bytes())
    data[:8] = (10**12).to_bytes(8, "little")  # header length now points past the end
    tensor_path.write_bytes(bytes(data))
    with pytest.raises(KVItemCorrupt):
        load_item(tmp_path, item.item_id, tiny_handle.fingerprint, verify_checksum=False)


@pytest.mark.parametrize(
    "field",
    ["weights_sha", "tokenizer_sha", "dtype", "chat_template_sha", "layout_version", "rope_sha", "arch_sha"],
)
def test_fingerprint_mismatch_is_refused(tmp_path, item, tiny_handle, field):
    save_item(item, tmp_path)
    other = dataclasses.replace(tiny_handle.fingerprint, **{field: "something-else"})
    with pytest.raises(FingerprintMismatch, match=field):
        load_item(tmp_path, item.item_id, other)


def test_fingerprint_tracks_weights_dtype_template_and_layout(tiny_handle, tokenizer):
    from kvmem.kv import LAYOUT_VERSION
    from kvmem.kv.fingerprint import fingerprint_model
    from tests.conftest import make_tiny_llama

    base = fingerprint_model(tiny_handle.model, tokenizer, layout_version=LAYOUT_VERSION)
    assert base == tiny_handle.fingerprint
    assert fingerprint_model(
        make_tiny_llama(len(tokenizer), seed=1), tokenizer, layout_version=LAYOUT_VERSION
    ).mismatches(base) == ["weights_sha"]
    assert fingerprint_model(tiny_handle.model, tokenizer, layout_version="1").mismatches(base) == [
        "layout_version"
    ]
    half = make_tiny_llama(len(tokenizer)).to(torch.bfloat16)
    assert set(fingerprint_model(half, tokenizer, layout_version=LAYOUT_VERSION).mismatches(base)) == {
        "weights_sha",
        "dtype",
    }
    original = tokenizer.chat_template
    try:
        tokenizer.chat_template = original + "{# changed #}"
        assert fingerprint_model(tiny_handle.model, tokenizer, layout_version=LAYOUT_VERSION).mismatches(
            base
        ) == ["chat_template_sha"]
    finally:
        tokenizer.chat_template = original


def test_disk_full_mid_write_keeps_existing_item(tmp_path, item, tiny_handle):
    """A real short write: the child process may only write files up to 64 KiB (RLIMIT_FSIZE)."""
    save_item(item, tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    script = textwrap.dedent(f"""
        import resource, signal, sys
        sys.path.insert(0, {os.getcwd()!r})
        from tests.conftest import make_tiny_llama
        from transformers import AutoTokenizer
        from kvmem.models import handle_for
        from kvmem.kv import PromptLayout, build_item
        from kvmem.kv.io import save_item
        from kvmem.errors import StorageError
        tok = AutoTokenizer.from_pretrained({str(tiny_handle.tokenizer.name_or_path)!r})
        h = handle_for(make_tiny_llama(len(tok)), tok, model_id="tiny")
        big = build_item(h, PromptLayout(tok).block_ids(["memory number %d is long enough" % i for i in range(60)]),
                         user_id="alice")
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))
        try:
            save_item(big, {str(tmp_path)!r})
        except StorageError as exc:
            print("STORAGE_ERROR", exc)
            sys.exit(0)
        sys.exit(3)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "STORAGE_ERROR" in proc.stdout and "disk full" in proc.stdout
    after = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert after == before  # no temp files left, the old item untouched
    assert torch.equal(load_item(tmp_path, item.item_id, tiny_handle.fingerprint).kv, item.kv)


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions; covered by the file case")
def test_unwritable_directory_raises_storage_error(tmp_path, item):
    tmp_path.chmod(0o500)
    with pytest.raises(StorageError, match="could not write"):
        save_item(item, tmp_path)


def test_directory_that_is_a_file_raises_storage_error(tmp_path, item):
    blocker = tmp_path / "kv"
    blocker.write_text("a file where the directory should be")
    with pytest.raises(StorageError, match="could not write"):
        save_item(item, blocker)


def test_empty_and_overlong_blocks_are_refused(tokenizer):
    from kvmem.models import handle_for
    from tests.conftest import make_tiny_llama

    handle = handle_for(make_tiny_llama(len(tokenizer), max_positions=64), tokenizer, model_id="tiny-64")
    with pytest.raises(InvalidBlock, match="empty block"):
        build_item(handle, [], user_id="alice")
    with pytest.raises(InvalidBlock, match="exceeds the model context"):
        build_item(handle, list(range(100, 164)), user_id="alice")
    with pytest.raises(InvalidBlock, match="outside the vocabulary"):
        build_item(handle, [len(tokenizer) + 5], user_id="alice")
    assert build_item(handle, list(range(100, 163)), user_id="alice").num_tokens == 63


def test_a_write_interrupted_by_ctrl_c_leaves_no_temporary_file(tmp_path, item, tiny_handle):
    """Only OSError and the like cleaned up: a KeyboardInterrupt mid-write left `.<id>.safetensors.tmp-...`,
    holding the user's K/V, which no scan, eviction or delete cascade ever looks at."""
    save_item(item, tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def interrupt(_busy_s: float) -> None:
        raise KeyboardInterrupt  # the signal arrives while the tensor file is written

    with pytest.raises(KeyboardInterrupt):
        save_item(item, tmp_path, pace=interrupt)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_opening_a_store_removes_the_temporary_files_of_writers_that_died(tmp_path, item, tiny_handle):
    """kill -9 runs no cleanup: the files of a writer whose process is gone are removed when a store opens; a
    live writer's (another process on the same directory, or this one) are left."""
    from kvmem.kv import KVStoreConfig, TieredKVStore

    save_item(item, tmp_path)
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead_pid = int(gone.stdout)
    dead = tmp_path / f".{item.item_id}.safetensors.tmp-{dead_pid}-123"
    live = tmp_path / f".{item.item_id}.safetensors.tmp-{os.getpid()}-456"
    for path in (dead, live):
        path.write_bytes(b"half a tensor file")
    TieredKVStore(KVStoreConfig(directory=str(tmp_path)), tiny_handle.fingerprint)
    assert not dead.exists() and live.exists()
    assert torch.equal(load_item(tmp_path, item.item_id, tiny_handle.fingerprint).kv, item.kv)

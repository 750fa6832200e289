"""Device/dtype at load time and the weights digest cache: a second start does not re-hash the weights;
a touched weight file, another dtype or a broken cache file means a fresh hash (never a wrong digest)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from kvmem.errors import ModelLoadError
from kvmem.kv import fingerprint
from kvmem.kv.fingerprint import Fingerprint
from kvmem.kv.prefill import build_item
from kvmem.models import load_model, parse_dtype, resolve_device


@pytest.fixture
def hashes(monkeypatch):
    """Every full pass over the weights, by the dtype hashed."""
    calls: list[torch.dtype] = []
    real = fingerprint.weights_sha

    def counting(model):
        calls.append(next(model.parameters()).dtype)
        return real(model)

    monkeypatch.setattr(fingerprint, "weights_sha", counting)
    return calls


def test_second_load_reads_the_digest_from_the_cache(tiny_model_dir, tmp_path, hashes):
    cache = tmp_path / "digests.json"
    first = load_model(str(tiny_model_dir), device="cpu", dtype="float32", digest_cache=cache)
    assert hashes == [torch.float32]
    assert first.fingerprint.weights_sha == fingerprint.weights_sha(first.model)  # the real digest
    hashes.clear()
    second = load_model(str(tiny_model_dir), device="cpu", dtype="float32", digest_cache=cache)
    assert hashes == []  # no pass over the weights
    assert second.fingerprint == first.fingerprint
    entry = next(iter(json.loads(cache.read_text())["entries"].values()))
    assert [os.path.basename(f[0]) for f in entry["identity"]["files"]] == ["model.safetensors"]


def test_a_touched_weight_file_is_rehashed(tiny_model_dir, tmp_path, hashes):
    cache = tmp_path / "digests.json"
    first = load_model(str(tiny_model_dir), dtype="float32", digest_cache=cache)
    weights = tiny_model_dir / "model.safetensors"
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    again = load_model(str(tiny_model_dir), dtype="float32", digest_cache=cache)
    assert len(hashes) == 2  # the touched file missed the cache
    assert again.fingerprint == first.fingerprint  # same bytes, same digest
    load_model(str(tiny_model_dir), dtype="float32", digest_cache=cache)
    assert len(hashes) == 2  # and the new identity is cached


@pytest.mark.parametrize(
    "content", ["{not json", '{"version": 1, "entries": {"x": 3}}', '["a list"]', '{"version": 99}', ""]
)
def test_a_broken_cache_file_is_ignored_and_rewritten(tiny_model_dir, tmp_path, hashes, content):
    cache = tmp_path / "digests.json"
    cache.write_text(content)
    handle = load_model(str(tiny_model_dir), dtype="float32", digest_cache=cache)
    assert hashes == [torch.float32]
    assert handle.fingerprint.weights_sha == fingerprint.weights_sha(handle.model)
    assert json.loads(cache.read_text())["version"] == 1  # rewritten, readable
    load_model(str(tiny_model_dir), dtype="float32", digest_cache=cache)
    assert len(hashes) == 2  # the one above (for the check) and no more: the rewritten cache serves


def test_a_cache_entry_with_a_wrong_identity_is_not_trusted(tiny_model_dir, tmp_path, hashes):
    """An entry whose stored identity differs from its key (edited by hand) is a miss, not a digest."""
    cache = tmp_path / "digests.json"
    load_model(str(tiny_model_dir), dtype="float32", digest_cache=cache)
    data = json.loads(cache.read_text())
    (entry,) = data["entries"].values()
    entry["weights_sha"] = "0" * 64
    entry["identity"]["dtype"] = "bfloat16"
    cache.write_text(json.dumps(data))
    handle = load_model(str(tiny_model_dir), dtype="float32", digest_cache=cache)
    assert len(hashes) == 2 and handle.fingerprint.weights_sha != "0" * 64


def test_dtype_follows_into_the_fingerprint_and_the_item_bytes(tiny_model_dir, tmp_path, hashes):
    cache = tmp_path / "digests.json"
    fp32 = load_model(str(tiny_model_dir), dtype="float32", digest_cache=cache)
    bf16 = load_model(str(tiny_model_dir), dtype="bfloat16", digest_cache=cache)
    assert hashes == [torch.float32, torch.bfloat16]  # one cache entry per dtype
    assert (fp32.dtype, bf16.dtype) == (torch.float32, torch.bfloat16)
    assert fp32.fingerprint.mismatches(bf16.fingerprint) == ["weights_sha", "dtype"]
    assert fp32.fingerprint.digest != bf16.fingerprint.digest  # an fp32 item is never served at bf16
    ids = fp32.tokenizer("a block of memories about the user", add_special_tokens=False)["input_ids"]
    a, b = (build_item(h, ids, user_id="u") for h in (fp32, bf16))
    assert (a.kv.dtype, b.kv.dtype) == (torch.float32, torch.bfloat16)
    assert a.meta.num_bytes == 2 * b.meta.num_bytes  # byte budgets hold twice the tokens at bf16


def test_device_is_not_in_the_fingerprint():
    """Decision: item files are portable (saved as CPU tensors, loaded onto the store's device), so an item
    built on a GPU serves on the CPU and back, at the same dtype. The fingerprint has no device field."""
    assert set(Fingerprint.__dataclass_fields__) == {
        "weights_sha",
        "tokenizer_sha",
        "dtype",
        "chat_template_sha",
        "layout_version",
        "rope_sha",
        "arch_sha",
        "adapter",  # the LoRA adapter the K/V were computed under ("" for the base model)
    }


def test_auto_device_and_dtype():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected and resolve_device(None).type == expected
    assert parse_dtype("auto", "cpu") == torch.float32
    assert parse_dtype("auto", resolve_device("auto")) == (
        torch.bfloat16 if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else torch.float32
    )
    with pytest.raises(ModelLoadError, match="unknown device 'tpu'"):
        resolve_device("tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible here")
def test_cuda_without_a_gpu_is_a_clear_error(tiny_model_dir, tmp_path):
    with pytest.raises(ModelLoadError, match="CUDA is not available"):
        load_model(str(tiny_model_dir), device="cuda", digest_cache=tmp_path / "d.json")


def test_an_adapter_changes_the_digest_and_the_base_fingerprint_is_as_before():
    fp = Fingerprint(*(f"v{i}" for i in range(7)))
    assert "adapter" not in fp.to_dict() and fp.base is fp
    under = fp.under("u1/v0001@v1-0123456789abcdef")
    assert under.digest != fp.digest and under.base == fp
    assert under.mismatches(fp) == ["adapter"]
    assert Fingerprint.from_dict(under.to_dict()) == under and Fingerprint.from_dict(fp.to_dict()) == fp
    assert fp.under(None) == fp.under("") == fp

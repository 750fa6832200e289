"""kvmem/kv/st_write.py writes what safetensors reads back: the same tensors, bit for bit, and the same
metadata, for every dtype a K/V item or its token ids can have, whole or in paced pieces, and returns the
SHA-256 of the file's bytes; what it cannot write is refused before a byte is written."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from kvmem.checksum import file_sha256
from kvmem.kv.st_write import paced, write_safetensors


def tensors_of_every_kind() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    kv = torch.randn(3, 2, 2, 37, 8, generator=g)
    return {
        "kv": kv,
        "kv_bf16": kv.to(torch.bfloat16),
        "kv_f16": kv.to(torch.float16),
        "kv_f64": kv[0].double(),
        "token_ids": torch.randint(0, 50_000, (37,), dtype=torch.int32, generator=g),
        "ids64": torch.arange(5, dtype=torch.int64),
        "small": torch.tensor([-3, 4], dtype=torch.int8),
        "bytes": torch.tensor([0, 255], dtype=torch.uint8),
        "flags": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
    }


def test_what_it_writes_safetensors_reads_back_exactly_with_its_metadata(tmp_path):
    tensors = tensors_of_every_kind()
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    metadata = {"format": "1", "item_id": "u-abc"}
    assert write_safetensors(tensors, ours, metadata=metadata) == file_sha256(ours)
    save_file(tensors, theirs, metadata=metadata)
    back, reference = load_file(ours), load_file(theirs)
    assert back.keys() == tensors.keys() == reference.keys()
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and back[name].shape == t.shape
        assert torch.equal(back[name], t) and torch.equal(back[name], reference[name]), name
    with safe_open(ours, "pt") as f:
        assert f.metadata() == metadata
    raw = ours.read_bytes()
    head = int.from_bytes(raw[:8], "little")
    assert head % 8 == 0 and len(raw) == len(theirs.read_bytes())  # the same bytes of data, no holes
    layout = json.loads(raw[8 : 8 + head])
    for name, t in tensors.items():  # every tensor starts at a multiple of its element size
        assert (8 + head + layout[name]["data_offsets"][0]) % t.element_size() == 0, name


def test_no_metadata_and_a_lone_tensor(tmp_path):
    path = tmp_path / "one.safetensors"
    write_safetensors({"kv": torch.ones(2, 3)}, path)
    assert torch.equal(load_file(path)["kv"], torch.ones(2, 3))
    with safe_open(path, "pt") as f:
        assert f.metadata() is None


@pytest.mark.parametrize(
    ("tensors", "metadata", "match"),
    [
        ({"kv": torch.ones(4, 3).t()}, None, "'kv'.*contiguous False"),
        ({"kv": torch.ones(2, dtype=torch.complex64)}, None, "'kv'.*complex64"),
        ({"__metadata__": torch.ones(2)}, None, "'__metadata__'"),
        ({"kv": torch.ones(2)}, {"format": 1}, "metadata must map strings to strings"),
    ],
)
def test_what_it_cannot_write_is_refused_before_the_file_is_touched(tmp_path, tensors, metadata, match):
    path = tmp_path / "x.safetensors"
    path.write_bytes(b"old")
    with pytest.raises(ValueError, match=match):
        write_safetensors(tensors, path, metadata=metadata)
    assert path.read_bytes() == b"old"


def test_paced_pieces_write_the_same_bytes_and_pause_after_each(tmp_path):
    tensors = tensors_of_every_kind()
    whole, pieces = tmp_path / "whole.safetensors", tmp_path / "pieces.safetensors"
    write_safetensors(tensors, whole)
    busy: list[float] = []
    digest = write_safetensors(tensors, pieces, pace=busy.append, piece_bytes=1000)
    assert pieces.read_bytes() == whole.read_bytes() and digest == file_sha256(whole)
    raw = whole.read_bytes()
    head = 8 + int.from_bytes(raw[:8], "little")
    sizes = [head] + [t.numel() * t.element_size() for t in tensors.values() if t.numel()]
    assert len(busy) == sum(-(-n // 1000) for n in sizes) and all(b >= 0 for b in busy)  # one per piece
    assert paced(1.0) is None
    with pytest.raises(ValueError, match=r"duty must be in \(0, 1\]"):
        paced(0)

"""Write CPU tensors as a safetensors file in pieces, hashing them as they go, optionally paced: the server
writes a built block's item (184 MB for a 4k-token block of the default model) while streams decode, and
on a 2-core machine the CPU a write takes (the kernel's copy into the page cache, the SHA-256, the disk
sync) comes from the model thread's OpenMP team: written at once, a block's write made its streams' longest
gaps between tokens (0.29 s and 0.39 s against a 0.096 s median, `benchmarks/engine/build_stall.py`). Paced, each
piece is synced to disk and followed by a pause (`pace`), so no step waits long for a core. The tensors'
memory is handed to `write` as is (one copy, the kernel's). Files are read back with safetensors itself,
which checks the header, offsets and sizes.

The format (https://huggingface.co/docs/safetensors): an 8-byte little-endian header length, a JSON header
naming each tensor's dtype, shape and [begin, end) byte offsets into the data that follows, plus an optional
`__metadata__` map of strings, padded with spaces to a multiple of 8 bytes, then the tensors' bytes, packed
(the widest dtypes first, so every tensor is aligned to its element size).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import time
from collections.abc import Callable

import torch

PIECE_BYTES = 8 << 20  # bytes written (and hashed, and synced when paced) at a time

_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_AS_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # numpy has no bfloat16


def paced(duty: float) -> Callable[[float], None] | None:
    """A `pace` that keeps a writer's CPU use at most `duty` of the time (a pause after each piece, for the CPU
    seconds it took), or None for 1."""
    if not 0 < duty <= 1:
        raise ValueError(f"a write's duty must be in (0, 1], got {duty}")
    if duty == 1:
        return None
    return lambda busy_s: time.sleep(busy_s * (1 / duty - 1))


def write_safetensors(
    tensors: dict[str, torch.Tensor],
    path: str | os.PathLike,
    metadata: dict[str, str] | None = None,
    *,
    pace: Callable[[float], None] | None = None,
    piece_bytes: int = PIECE_BYTES,
) -> str:
    """Write `tensors` (contiguous, on the CPU) and `metadata` to `path`, as safetensors' `save_file` does, and
    return the SHA-256 (hex) of the file's bytes. With `pace`, each piece of `piece_bytes` is synced to disk
    (`fdatasync`) and `pace` is called with the CPU seconds this thread spent on it (it sleeps: see `paced`). Raises
    ValueError for a tensor it cannot write as is (on another device, not contiguous, a dtype with no
    safetensors name) and OSError for the file."""
    header: dict[str, object] = {}
    if metadata:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise ValueError("safetensors metadata must map strings to strings")
        header["__metadata__"] = dict(metadata)
    # the widest elements first (then by name), so that each tensor's data starts at a multiple of its
    # element size after the 8-aligned header, as safetensors lays them out
    order = sorted(tensors.items(), key=lambda kv: (-kv[1].element_size(), kv[0]))
    offset = 0
    for name, t in order:
        if (
            name == "__metadata__"
            or t.device.type != "cpu"
            or not t.is_contiguous()
            or t.dtype not in _DTYPES
        ):
            raise ValueError(
                f"tensor {name!r} ({t.dtype} on {t.device}, contiguous {t.is_contiguous()}) cannot be written"
            )
        size = t.numel() * t.element_size()
        header[name] = {
            "dtype": _DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    digest = hashlib.sha256()
    with open(path, "wb", buffering=0) as fh:

        def put(data: memoryview) -> None:
            for start in range(0, len(data), piece_bytes):
                cpu0 = time.thread_time()  # this thread's CPU: waiting for the disk takes no core
                piece = data[start : start + piece_bytes]
                while piece:  # a raw write may take fewer bytes than it is given
                    piece = piece[fh.write(piece) :]
                digest.update(data[start : start + piece_bytes])
                if pace is not None:
                    os.fdatasync(fh.fileno())
                    pace(time.thread_time() - cpu0)

        put(memoryview(struct.pack("<Q", len(head)) + head))
        for _, t in order:
            if t.numel():
                raw = t.view(_AS_INT[t.element_size()]) if t.dtype in (torch.bfloat16, torch.bool) else t
                put(memoryview(raw.reshape(-1).numpy()).cast("B"))
    return digest.hexdigest()

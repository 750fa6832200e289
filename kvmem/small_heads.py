"""Small learned heads shipped as safetensors files (the search's query head, formation's change head): reading
one with checks, its content hash, and writing one so that it is never seen half written.

A head file holds a fixed set of float32 tensors and string metadata with a `format`. Reading refuses anything
else with the caller's error class, naming the file and the reason: no file, not safetensors, another format,
other tensor names, a tensor not float32 or not finite. Shapes are the caller's to check (they depend on the
head). The content hash covers the metadata and the tensors in a fixed order, not the file's bytes
(safetensors writes metadata keys in any order). No pickle: safetensors and numpy only.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np


def content_sha256(tensors: dict[str, np.ndarray], metadata: dict[str, str], names: Sequence[str]) -> str:
    """sha256 of a head's content: the metadata as canonical JSON, then each tensor's name, shape and
    little-endian float32 bytes in `names` order."""
    digest = hashlib.sha256(json.dumps(metadata, sort_keys=True, separators=(",", ":")).encode("utf-8"))
    for name in names:
        value = np.ascontiguousarray(tensors[name], dtype="<f4")
        digest.update(f"{name}:{list(value.shape)}".encode())
        digest.update(value.tobytes())
    return digest.hexdigest()


def read_head(
    path: Path, fmt: str, names: Sequence[str], error: type[Exception], what: str = "head"
) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The tensors (exactly `names`, float32, finite) and metadata (its `format` is `fmt`) of the head file at
    `path`; `error(message)` naming the file (`what` it is) and the reason otherwise."""
    from safetensors import SafetensorError, safe_open

    if not path.is_file():
        raise error(f"{path}: {what} cannot be read (no such file)")
    try:
        with safe_open(str(path), framework="numpy") as f:
            metadata = f.metadata() or {}
            found = set(f.keys())
            tensors = {name: f.get_tensor(name) for name in names if name in found}
    except (SafetensorError, OSError, ValueError) as exc:
        raise error(f"{path}: not a safetensors file ({exc})") from exc
    if metadata.get("format") != fmt:
        raise error(f"{path}: format must be {fmt!r}, got {metadata.get('format')!r}")
    if found != set(names):
        raise error(f"{path}: tensors must be exactly {list(names)}, got {sorted(found)}")
    for name in names:
        if tensors[name].dtype != np.float32:
            raise error(f"{path}: {name} must be float32, got {tensors[name].dtype}")
        if not np.isfinite(tensors[name]).all():
            raise error(f"{path}: {name} holds a value that is not finite")
    return tensors, metadata


def write_head(
    path: Path, tensors: dict[str, np.ndarray], metadata: dict[str, str], names: Sequence[str]
) -> Path:
    """Writes the tensors `names` (as float32) and the metadata to a temporary name beside `path` and returns
    it; the caller loads it with its own checks and then renames it into place (`Path.replace`)."""
    from safetensors.numpy import save_file

    tmp = path.with_name(path.name + ".tmp")
    save_file(
        {name: np.ascontiguousarray(tensors[name], dtype=np.float32) for name in names},
        str(tmp),
        metadata=metadata,
    )
    return tmp

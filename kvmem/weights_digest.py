"""The weights digest of a loaded model, cached by the identity of its weight files.

Hashing every weight (fingerprint.weights_sha) costs a full pass over the model: about 1 s for the default
135M model, minutes for an 8B one on a GPU (16 GB copied to the host and hashed). The digest of the same
files loaded at the same dtype is the same, so it is kept in a small JSON file keyed by each weight file's
(resolved path, size, mtime_ns), the dtype and the torch/transformers versions (which decide how a file
becomes tensors, e.g. GGUF dequantization). Any change (a touched or replaced file, another dtype, an
upgrade) misses the cache and re-hashes. A missing, unreadable or malformed cache file is ignored (and
rewritten); a cache that cannot be written costs a re-hash next start, nothing else.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

import torch

from kvmem.kv import fingerprint

log = logging.getLogger(__name__)

CACHE_FILE = "weights_digests.json"
_VERSION = 1
_MAX_ENTRIES = 64  # models x dtypes remembered; the oldest entries are dropped beyond this
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def weight_files(src: str, gguf_file: str | None = None) -> list[Path] | None:
    """The files the weights were read from, or None when they cannot be named here (then no caching)."""
    if gguf_file is not None:
        path = Path(src) / gguf_file
        return [path] if path.is_file() else None
    root = Path(src)
    if not root.is_dir():
        root = _hub_snapshot(src)
        if root is None:
            return None
    files = sorted(p for p in root.iterdir() if p.is_file() and p.name.endswith(_WEIGHT_SUFFIXES))
    return files or None


def _hub_snapshot(repo_id: str) -> Path | None:
    """The local snapshot of a hub model id, without any network access; None if it is not cached."""
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached, not a repo id, no hub library: just do not cache
        return None


def weights_identity(files: list[Path] | None, dtype: torch.dtype) -> dict | None:
    """What the cache is keyed by; taken before the weights are read, so a file replaced while the model
    loads is not remembered under its old identity. None when the files are unknown."""
    import transformers

    if files is None:
        return None
    entries = []
    for path in files:
        st = path.stat()  # follows the hub's symlinks to the blobs
        entries.append([str(path.resolve()), st.st_size, st.st_mtime_ns])
    return {
        "files": entries,
        "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def _key(identity: dict) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def _read(cache_path: Path) -> dict[str, dict]:
    try:
        data = json.loads(cache_path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.warning("ignoring the weights digest cache %s: %s", cache_path, exc)
        return {}
    entries = data.get("entries") if isinstance(data, dict) and data.get("version") == _VERSION else None
    if not isinstance(entries, dict):
        log.warning("ignoring the weights digest cache %s: not a version %d cache", cache_path, _VERSION)
        return {}
    return {k: v for k, v in entries.items() if isinstance(v, dict)}


def _write(cache_path: Path, entries: dict[str, dict]) -> None:
    """Atomic (temporary file + rename): a reader sees the old cache or the new one, never a torn one."""
    try:
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".weights-", dir=cache_path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"version": _VERSION, "entries": entries}, f, indent=1)  # insertion order: age
            os.replace(tmp, cache_path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as exc:
        log.warning("could not write the weights digest cache %s: %s", cache_path, exc)


def cached_weights_sha(
    model: torch.nn.Module, files: list[Path] | None, identity: dict | None, cache_path: Path | None
) -> str:
    """The model's weights digest (fingerprint.weights_sha), from the cache when its files are unchanged.
    `identity` is weights_identity(files, dtype) taken before the model was loaded from `files`."""
    if files is None or identity is None or cache_path is None:
        return fingerprint.weights_sha(model)
    key = _key(identity)
    entries = _read(cache_path)
    hit = entries.get(key)
    if hit is not None and hit.get("identity") == identity and isinstance(hit.get("weights_sha"), str):
        return hit["weights_sha"]
    digest = fingerprint.weights_sha(model)
    if weights_identity(files, next(model.parameters()).dtype) != identity:  # changed since: not cached
        return digest
    entries.pop(key, None)
    entries[key] = {"identity": identity, "weights_sha": digest}
    while len(entries) > _MAX_ENTRIES:
        entries.pop(next(iter(entries)))
    _write(cache_path, entries)
    return digest

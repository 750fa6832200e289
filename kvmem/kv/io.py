"""KV item files: tensors in safetensors, metadata in a JSON manifest, checksummed, written atomically.

Layout in a directory: `<item_id>.safetensors` (tensors `kv` and `token_ids`) and `<item_id>.json`
(manifest with the tensor file's SHA-256). The manifest is renamed into place last, so it is the commit
point: a crash leaves either the old item, or no manifest (treated as absent). No pickle is involved.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import threading
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load as load_bytes

from kvmem.checksum import file_sha256
from kvmem.errors import FingerprintMismatch, KVItemCorrupt, KVItemNotFound, StorageError
from kvmem.kv.fingerprint import Fingerprint
from kvmem.kv.item import KVItem, KVItemMeta, tokens_sha
from kvmem.kv.st_write import write_safetensors

FORMAT_VERSION = 1


def item_paths(directory: Path, item_id: str) -> tuple[Path, Path]:
    return directory / f"{item_id}.safetensors", directory / f"{item_id}.json"


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_item(item: KVItem, directory: str | os.PathLike, pace: Callable[[float], None] | None = None) -> int:
    """Write an item atomically; returns bytes written. Raises StorageError and leaves old files intact.
    `pace`: the tensor file is written in synced pieces with a pause after each (kvmem/kv/st_write.py)."""
    directory = Path(directory)
    tensor_path, manifest_path = item_paths(directory, item.item_id)
    writer = f"{os.getpid()}-{threading.get_ident()}"  # two threads may write the same item at once
    tmp_tensor = tensor_path.with_name(f".{tensor_path.name}.tmp-{writer}")
    tmp_manifest = manifest_path.with_name(f".{manifest_path.name}.tmp-{writer}")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        # a child stores its own tokens' K/V only (its `kv` may hold them alone, or every token's)
        own = item.kv[:, :, :, item.meta.parent_tokens - item.own_start :]
        tensors = {
            "kv": own.detach().to("cpu").contiguous(),
            "token_ids": torch.tensor(item.token_ids, dtype=torch.int32),
        }
        sha256 = write_safetensors(
            tensors, tmp_tensor, {"format": str(FORMAT_VERSION), "item_id": item.item_id}, pace=pace
        )
        with open(tmp_tensor, "rb+") as fh:
            os.fsync(fh.fileno())
        manifest = {
            "format": FORMAT_VERSION,
            "meta": item.meta.to_dict(),
            "file_sha256": sha256,  # of the bytes as they were written
            "file_bytes": tmp_tensor.stat().st_size,
        }
        with open(tmp_manifest, "w") as fh:
            json.dump(manifest, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp_tensor, tensor_path)
        os.replace(tmp_manifest, manifest_path)
        _fsync_dir(directory)
        return manifest["file_bytes"]
    except (OSError, SafetensorError, ValueError) as exc:
        for tmp in (tmp_tensor, tmp_manifest):
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass  # the directory itself is unusable; there is nothing of ours to clean
        raise StorageError(
            f"could not write KV item {item.item_id} to {directory}: {_write_failure(exc)}"
        ) from exc
    except BaseException:  # Ctrl-C mid-write: nothing half-written stays (no scan or delete ever sees it)
        for tmp in (tmp_tensor, tmp_manifest):
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
        raise


_FULL_ERRNOS = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)


def _write_failure(exc: BaseException) -> str:
    """'disk full (...)' for out-of-space errors (errno, or the os error safetensors reports), else the cause."""
    text = getattr(exc, "strerror", None) or str(exc)
    full = getattr(exc, "errno", None) in _FULL_ERRNOS or any(
        f"os error {n})" in str(exc) for n in _FULL_ERRNOS
    )
    return f"disk full ({text})" if full else text


def read_manifest(directory: str | os.PathLike, item_id: str) -> dict:
    """The parsed manifest; KVItemNotFound if absent, KVItemCorrupt if unreadable or malformed."""
    _, manifest_path = item_paths(Path(directory), item_id)
    try:
        with open(manifest_path) as fh:
            manifest = json.load(fh)
        KVItemMeta.from_dict(manifest["meta"])
        manifest["file_sha256"], manifest["file_bytes"]  # noqa: B018 - presence check
    except FileNotFoundError as exc:
        raise KVItemNotFound(f"KV item {item_id} not found in {directory}") from exc
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise KVItemCorrupt(f"KV item {item_id}: manifest unreadable or malformed ({exc})") from exc
    if manifest.get("format") != FORMAT_VERSION:
        raise KVItemCorrupt(f"KV item {item_id}: unsupported format {manifest.get('format')!r}")
    return manifest


def load_item(
    directory: str | os.PathLike,
    item_id: str,
    expected: Fingerprint,
    *,
    device: torch.device | str = "cpu",
    verify_checksum: bool = True,
) -> KVItem:
    """Load and verify an item. Raises KVItemNotFound, KVItemCorrupt or FingerprintMismatch. A child item
    (`meta.parent_id`) comes back with its own K/V only; the store attaches its parent (store.get)."""
    manifest, meta, tensor_path = _checked_manifest(Path(directory), item_id, expected)
    # One read: the bytes that are hashed are the bytes that are parsed (no window between check and use),
    # and the tensors own their memory (no mmap of a file someone could rewrite in place).
    try:
        data = tensor_path.read_bytes()
    except OSError as exc:
        raise KVItemCorrupt(f"KV item {item_id}: tensor file unreadable ({exc})") from exc
    if verify_checksum and hashlib.sha256(data).hexdigest() != manifest["file_sha256"]:
        raise KVItemCorrupt(f"KV item {item_id}: tensor file fails its SHA-256 checksum")
    try:
        tensors = {k: t.to(device) for k, t in load_bytes(data).items()}
    except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
        raise KVItemCorrupt(f"KV item {item_id}: tensor file unreadable ({exc})") from exc
    del data
    kv = tensors.get("kv")
    token_ids = _checked_tensors(meta, None if kv is None else tuple(kv.shape), tensors.get("token_ids"))
    return KVItem(meta=meta, token_ids=token_ids, kv=kv)


def verify_item(directory: str | os.PathLike, item_id: str, expected: Fingerprint) -> KVItemMeta:
    """What `load_item` checks (manifest, fingerprint, size, SHA-256, shapes, token ids), without reading the
    K/V into memory: the file is hashed as it streams, the shapes come from its header. For resumable builds
    and restores (a third of a load's time at 46 MB); serving still verifies every item it loads. Raises as
    `load_item` does."""
    manifest, meta, tensor_path = _checked_manifest(Path(directory), item_id, expected)
    try:
        if file_sha256(tensor_path) != manifest["file_sha256"]:
            raise KVItemCorrupt(f"KV item {item_id}: tensor file fails its SHA-256 checksum")
        with safe_open(str(tensor_path), framework="pt") as f:
            names = set(f.keys())
            shape = tuple(f.get_slice("kv").get_shape()) if "kv" in names else None
            token_tensor = f.get_tensor("token_ids") if "token_ids" in names else None
    except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
        raise KVItemCorrupt(f"KV item {item_id}: tensor file unreadable ({exc})") from exc
    _checked_tensors(meta, shape, token_tensor)
    return meta


def _checked_manifest(directory: Path, item_id: str, expected: Fingerprint) -> tuple[dict, KVItemMeta, Path]:
    manifest = read_manifest(directory, item_id)
    meta = KVItemMeta.from_dict(manifest["meta"])
    if meta.item_id != item_id:
        raise KVItemCorrupt(f"KV item {item_id}: manifest names item {meta.item_id}")
    diff = expected.base.mismatches(meta.fingerprint.base)  # the adapter is the reader's check (item.meta)
    if diff:
        raise FingerprintMismatch(f"KV item {item_id} was built with a different {', '.join(diff)}")
    tensor_path, _ = item_paths(directory, item_id)
    try:
        size = tensor_path.stat().st_size
    except FileNotFoundError as exc:
        raise KVItemCorrupt(f"KV item {item_id}: tensor file missing") from exc
    if size != manifest["file_bytes"]:
        raise KVItemCorrupt(
            f"KV item {item_id}: tensor file is {size} bytes, expected {manifest['file_bytes']}"
        )
    return manifest, meta, tensor_path


def _checked_tensors(meta: KVItemMeta, kv_shape: tuple | None, token_tensor) -> tuple[int, ...]:
    """The token ids, once the K/V's shape and the ids match the manifest."""
    item_id = meta.item_id
    own_tokens = meta.num_tokens - meta.parent_tokens  # a child's file holds its own tokens' K/V only
    expected_shape = (meta.num_layers, 2, meta.num_kv_heads, own_tokens, meta.head_dim)
    if kv_shape is None or token_tensor is None or kv_shape != expected_shape:
        raise KVItemCorrupt(
            f"KV item {item_id}: tensors missing or shaped {kv_shape}, expected {expected_shape}"
        )
    token_ids = tuple(int(t) for t in token_tensor.tolist())
    if tokens_sha(token_ids) != meta.tokens_sha:
        raise KVItemCorrupt(f"KV item {item_id}: token ids do not match the manifest")
    return token_ids


def delete_item_files(directory: str | os.PathLike, item_id: str) -> bool:
    """Remove an item's files (manifest first, so a half-deleted item reads as absent)."""
    tensor_path, manifest_path = item_paths(Path(directory), item_id)
    existed = manifest_path.exists() or tensor_path.exists()
    manifest_path.unlink(missing_ok=True)
    tensor_path.unlink(missing_ok=True)
    return existed


_TMP_RE = re.compile(r"^\..+\.tmp-(\d+)-\d+$")


def sweep_stale_writes(directory: str | os.PathLike) -> int:
    """Remove the temporary files of writes whose process is gone (killed mid-write: kill -9 runs no cleanup;
    a live process's, another server's or `kvmem build`'s on the same directory, are left). Returns how many."""
    directory = Path(directory)
    if not directory.is_dir():
        return 0
    removed = 0
    for path in directory.iterdir():
        match = _TMP_RE.match(path.name)
        if match is None or _alive(int(match.group(1))):
            continue
        try:
            path.unlink()
            removed += 1
        except OSError:
            pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    return True


def list_item_ids(directory: str | os.PathLike) -> list[str]:
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(p.stem for p in directory.glob("*.json") if not p.name.startswith("."))

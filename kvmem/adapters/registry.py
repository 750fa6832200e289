"""The adapter registry: immutable LoRA adapter versions per user under DATA_DIR/adapters, and one active pointer
per user, with rollback.

Layout: `<user_key>/v0001/{adapter_model.safetensors, adapter_config.json, kvmem_adapter.json}` (peft's safe
serialization + our JSON manifest) and `<user_key>/active.json` (the active version and the history of active
versions, written to a temporary name and renamed into place). A version directory is written under a
temporary name and renamed into place once complete; it is never modified afterwards. Weights are read with
safetensors only, after their content hash is checked: no pickle. Knows nothing of training or serving.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import threading
import uuid
from collections.abc import Callable, Iterable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from kvmem.adapters.manifest import (
    CONFIG_FILE,
    MANIFEST_FILE,
    WEIGHTS_FILE,
    AdapterCorrupt,
    AdapterManifest,
    AdapterMismatch,
    AdapterNotFound,
    FactRef,
    user_key,
)
from kvmem.checksum import file_sha256

log = logging.getLogger(__name__)

ACTIVE_FILE = "active.json"


def _write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class AdapterRegistry:
    """Thread-safe (one lock around pointer changes). Readers of `active` take no lock: the pointer file is
    replaced atomically, so they see the old or the new one."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self._lock = threading.Lock()

    # -- paths ------------------------------------------------------------------------------------------------
    def user_dir(self, user_id: str) -> Path:
        return self.root / user_key(user_id)

    def version_dir(self, user_id: str, version: int) -> Path:
        return self.user_dir(user_id) / f"v{version:04d}"

    def path_of(self, manifest: AdapterManifest) -> Path:
        return self.root / manifest.adapter_id

    # -- writing a version ------------------------------------------------------------------------------------
    def write(
        self,
        user_id: str,
        save: Callable[[Path], None],
        *,
        base_fingerprint: str,
        facts: Iterable[FactRef],
        seed: int,
        passed: bool,
        reason: str = "",
        gates: dict[str, float] | None = None,
        train: dict[str, Any] | None = None,
        served_ids: Iterable[str] | None = None,
    ) -> AdapterManifest:
        """A new version: `save(dir)` writes the peft files (`save_pretrained(dir, safe_serialization=True)`)
        into a temporary directory; their hashes and the manifest go beside them and the directory is renamed
        to the next free version. Not activated. `served_ids`: the facts it is served for (None: all of `facts`).
        Raises AdapterCorrupt if `save` wrote no safetensors or `served_ids` names a memory not in `facts`."""
        udir = self.user_dir(user_id)
        udir.mkdir(parents=True, exist_ok=True)
        tmp = udir / f".tmp-{uuid.uuid4().hex}"
        tmp.mkdir()
        try:
            save(tmp)
            for name in (WEIGHTS_FILE, CONFIG_FILE):
                if not (tmp / name).is_file():
                    raise AdapterCorrupt(f"the adapter save wrote no {name}")
            for stray in tmp.iterdir():  # peft writes a README; anything pickled is refused outright
                if stray.suffix in (".bin", ".pt", ".pth", ".pkl"):
                    raise AdapterCorrupt(f"the adapter save wrote a pickle file {stray.name}")
            # never a number used before, by a version on disk or by one erased (a name is never reused)
            version = max([m.version for m in self.versions(user_id)] + self._erased(user_id), default=0) + 1
            while True:
                manifest = AdapterManifest(
                    user_id=user_id,
                    version=version,
                    base_fingerprint=base_fingerprint,
                    facts=tuple(facts),
                    seed=seed,
                    sha256=file_sha256(tmp / WEIGHTS_FILE),
                    config_sha256=file_sha256(tmp / CONFIG_FILE),
                    created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                    passed=passed,
                    reason=reason,
                    gates=dict(gates or {}),
                    train=dict(train or {}),
                    served_ids=None if served_ids is None else tuple(served_ids),
                )
                _write_json_atomic(tmp / MANIFEST_FILE, manifest.to_dict())
                try:
                    os.rename(tmp, self.version_dir(user_id, version))
                    break
                except OSError:  # another writer took this version number
                    version += 1
            log.info(
                "adapter %s written (passed=%s%s)", manifest.name, passed, f": {reason}" if reason else ""
            )
            return manifest
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)

    # -- reading versions -------------------------------------------------------------------------------------
    def manifest(self, user_id: str, version: int) -> AdapterManifest:
        path = self.version_dir(user_id, version) / MANIFEST_FILE
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError as exc:
            raise AdapterNotFound(f"user {user_id!r} has no adapter version {version}") from exc
        except (OSError, ValueError) as exc:
            raise AdapterCorrupt(f"adapter manifest {path} is unreadable: {exc}") from exc
        manifest = AdapterManifest.from_dict(data)
        if manifest.user_id != user_id or manifest.version != version:
            raise AdapterMismatch(f"adapter manifest {path} names user/version of another adapter")
        return manifest

    def versions(self, user_id: str) -> list[AdapterManifest]:
        """Every readable version of the user's, oldest first (unreadable ones are logged and skipped)."""
        out = []
        udir = self.user_dir(user_id)
        for d in sorted(udir.glob("v[0-9][0-9][0-9][0-9]")) if udir.is_dir() else ():
            try:
                out.append(self.manifest(user_id, int(d.name[1:])))
            except (AdapterNotFound, AdapterCorrupt, AdapterMismatch) as exc:
                log.warning("adapter version %s skipped: %s", d, exc)
        return out

    def verify(self, manifest: AdapterManifest, base_fingerprint: str | None = None) -> str | None:
        """Why this version must not be served, or None: its files' hashes, its base model, its gates."""
        directory = self.path_of(manifest)
        for name, want in ((WEIGHTS_FILE, manifest.sha256), (CONFIG_FILE, manifest.config_sha256)):
            try:
                got = file_sha256(directory / name)
            except OSError as exc:
                return f"{name} unreadable: {exc}"
            if got != want:
                return f"{name} hash mismatch (manifest {want[:16]}, file {got[:16]})"
        if base_fingerprint is not None and manifest.base_fingerprint != base_fingerprint:
            return f"trained on base model {manifest.base_fingerprint}, this model is {base_fingerprint}"
        if not manifest.passed:
            return f"refused by its gates: {manifest.reason}"
        return None

    def load(self, manifest: AdapterManifest, base_fingerprint: str | None = None) -> LoadedAdapter:
        """The version's LoRA config and weights, read with safetensors after the bytes read match the
        manifest's hash (one read: what is hashed is what is parsed). Raises AdapterCorrupt / AdapterMismatch."""
        from safetensors.torch import load as load_safetensors

        directory = self.path_of(manifest)
        if base_fingerprint is not None and manifest.base_fingerprint != base_fingerprint:
            raise AdapterMismatch(f"adapter {manifest.name} was trained on another base model")
        try:
            weights = (directory / WEIGHTS_FILE).read_bytes()
            config_bytes = (directory / CONFIG_FILE).read_bytes()
        except OSError as exc:
            raise AdapterCorrupt(f"adapter {manifest.name} files unreadable: {exc}") from exc
        if hashlib.sha256(weights).hexdigest() != manifest.sha256:
            raise AdapterCorrupt(f"adapter {manifest.name}: {WEIGHTS_FILE} fails its hash")
        if hashlib.sha256(config_bytes).hexdigest() != manifest.config_sha256:
            raise AdapterCorrupt(f"adapter {manifest.name}: {CONFIG_FILE} fails its hash")
        try:
            state = load_safetensors(weights)
            config = json.loads(config_bytes)
        except Exception as exc:  # noqa: BLE001 - any parse failure of hashed bytes is corruption
            raise AdapterCorrupt(f"adapter {manifest.name} does not parse: {exc}") from exc
        return LoadedAdapter(manifest, config, state)

    # -- the active pointer -----------------------------------------------------------------------------------
    def _pointer(self, user_id: str) -> dict[str, Any]:
        path = self.user_dir(user_id) / ACTIVE_FILE
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return {"version": None, "history": [], "reason": ""}
        except (OSError, ValueError) as exc:
            log.error("adapter pointer %s unreadable (%s): no adapter served for this user", path, exc)
            return {"version": None, "history": [], "reason": "pointer unreadable"}
        if data.get("user_id") != user_id:
            log.error("adapter pointer %s names another user: no adapter served", path)
            return {"version": None, "history": [], "reason": "pointer of another user"}
        return data

    def _erased(self, user_id: str) -> list[int]:
        return [int(v) for v in self._pointer(user_id).get("erased", [])]

    def _set_pointer(
        self,
        user_id: str,
        version: int | None,
        history: list[int],
        reason: str,
        erased: list[int] | None = None,
    ) -> None:
        self.user_dir(user_id).mkdir(parents=True, exist_ok=True)
        data = {
            "user_id": user_id,
            "version": version,
            "history": history,
            "reason": reason,
            "erased": sorted(self._erased(user_id) if erased is None else erased),
            "updated_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }
        _write_json_atomic(self.user_dir(user_id) / ACTIVE_FILE, data)

    def active(self, user_id: str) -> AdapterManifest | None:
        """The user's active version, or None (none, deactivated, or its manifest unreadable: logged). Cheap:
        the files' hashes are checked when the weights are loaded (`load`), not here."""
        version = self._pointer(user_id).get("version")
        if version is None:
            return None
        try:
            return self.manifest(user_id, int(version))
        except (AdapterNotFound, AdapterCorrupt, AdapterMismatch) as exc:
            log.error("active adapter v%s of user %r not served: %s", version, user_id, exc)
            return None

    def activate(self, user_id: str, version: int, base_fingerprint: str | None = None) -> AdapterManifest:
        """Make `version` the served one (it must pass `verify`). The previous active version goes on the
        history, for rollback. Raises AdapterCorrupt/AdapterMismatch/AdapterNotFound with the reason."""
        with self._lock:
            manifest = self.manifest(user_id, version)
            why = self.verify(manifest, base_fingerprint)
            if why is not None:
                raise AdapterCorrupt(f"adapter {manifest.name} cannot be activated: {why}")
            pointer = self._pointer(user_id)
            history = [int(v) for v in pointer.get("history", [])]
            if pointer.get("version") is not None and int(pointer["version"]) != version:
                history.append(int(pointer["version"]))
            self._set_pointer(user_id, version, history, "")
            log.info("adapter %s active for user %r", manifest.name, user_id)
            return manifest

    def deactivate(self, user_id: str, reason: str) -> AdapterManifest | None:
        """Stop serving the user's adapter (the pointer now names none); returns what was active. The version
        stays on disk and on the history."""
        with self._lock:
            pointer = self._pointer(user_id)
            if pointer.get("version") is None:
                return None
            was = int(pointer["version"])
            history = [int(v) for v in pointer.get("history", [])] + [was]
            self._set_pointer(user_id, None, history, reason)
        log.warning("adapter v%d of user %r no longer served: %s", was, user_id, reason)
        try:
            return self.manifest(user_id, was)
        except (AdapterNotFound, AdapterCorrupt, AdapterMismatch):
            return None

    def rollback(self, user_id: str, base_fingerprint: str | None = None) -> AdapterManifest | None:
        """Serve the most recent previously active version that still verifies; None (nothing served) when
        there is none. The version rolled back from is not put back on the history."""
        with self._lock:
            pointer = self._pointer(user_id)
            history = [int(v) for v in pointer.get("history", [])]
            current = pointer.get("version")
            while history:
                version = history.pop()
                if current is not None and version == int(current):
                    continue
                try:
                    manifest = self.manifest(user_id, version)
                except (AdapterNotFound, AdapterCorrupt, AdapterMismatch) as exc:
                    log.warning("rollback of user %r skips v%d: %s", user_id, version, exc)
                    continue
                why = self.verify(manifest, base_fingerprint)
                if why is not None:
                    log.warning("rollback of user %r skips v%d: %s", user_id, version, why)
                    continue
                self._set_pointer(user_id, version, history, "rollback")
                log.info("adapter %s active again for user %r (rollback)", manifest.name, user_id)
                return manifest
            self._set_pointer(user_id, None, history, "rollback: no earlier version")
            return None

    def erase(self, user_id: str, versions: Iterable[int], reason: str) -> list[AdapterManifest]:
        """Delete these versions of the user's from disk (the delete cascade: versions that hold a deleted or
        changed memory). Before any file goes, the pointer stops naming them (nothing is served if it named
        one) and they leave the history, so no rollback returns to them; their numbers are kept as erased, so a
        later version never takes one. Each directory is renamed away first (atomic: a reader finds the version
        whole or not at all), then removed. Returns the manifests of the erased versions that were readable."""
        doomed = {int(v) for v in versions}
        if not doomed:
            return []
        erased: list[AdapterManifest] = []
        with self._lock:
            pointer = self._pointer(user_id)
            current = pointer.get("version")
            current = None if current is None or int(current) in doomed else int(current)
            history = [int(v) for v in pointer.get("history", []) if int(v) not in doomed]
            self._set_pointer(
                user_id,
                current,
                history,
                reason
                if current is None and pointer.get("version") is not None
                else pointer.get("reason", ""),
                sorted(set(self._erased(user_id)) | doomed),
            )
            for version in sorted(doomed):
                directory = self.version_dir(user_id, version)
                try:
                    erased.append(self.manifest(user_id, version))
                except (AdapterNotFound, AdapterCorrupt, AdapterMismatch):
                    pass
                if not directory.is_dir():
                    continue
                trash = directory.with_name(f".erased-{uuid.uuid4().hex}")
                os.rename(directory, trash)
                shutil.rmtree(trash, ignore_errors=True)
        log.warning(
            "adapter version(s) %s of user %r erased: %s",
            ", ".join(f"v{v}" for v in sorted(doomed)),
            user_id,
            reason,
        )
        return erased

    def deactivate_covering(self, user_id: str, memory_ids: Iterable[str] | None, reason: str) -> bool:
        """The delete cascade: if the active adapter holds any of `memory_ids` (None: any memory at all), it
        stops being served before this returns. True if one was deactivated."""
        manifest = self.active(user_id)
        if manifest is None:
            return False
        if memory_ids is not None and not set(memory_ids) & set(manifest.memory_ids):
            return False
        return self.deactivate(user_id, reason) is not None


class LoadedAdapter:
    """A verified version's peft config (dict, as in adapter_config.json) and weights (name -> tensor)."""

    def __init__(self, manifest: AdapterManifest, config: dict[str, Any], state: dict[str, Any]) -> None:
        self.manifest, self.config, self.state = manifest, config, state

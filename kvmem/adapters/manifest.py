"""An adapter version's manifest: what produced it (base model fingerprint, the facts and their versions, seed),
the gate figures it was admitted with, and the content hashes of its files. JSON only.

Owns the names an adapter is known by (`adapter_id`, the served `name`). Knows nothing of files or training.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field
from typing import Any

from kvmem.errors import KvmemError

MANIFEST_FILE = "kvmem_adapter.json"  # the name vLLM's adapter_ref reads beside the peft files
WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
FORMAT_VERSION = 1


class AdapterError(KvmemError):
    """An adapter cannot be served; the caller serves the user's memories as KV/text instead."""


class AdapterNotFound(AdapterError):
    """No such adapter version (never written, or removed)."""


class AdapterCorrupt(AdapterError):
    """An adapter's files are missing, unreadable, or fail their content hash."""


class AdapterMismatch(AdapterError):
    """An adapter was trained on another base model (fingerprint) or belongs to another user."""


def user_key(user_id: str) -> str:
    """The directory name of a user's adapters: a hash, so no user id can name a path outside the registry."""
    return "u" + hashlib.sha256(user_id.encode()).hexdigest()[:24]


def text_sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class FactRef:
    """A memory as it was distilled: its id, its version then, and a hash of its text then."""

    memory_id: str
    version: int
    text_sha: str


def adapter_name(adapter_id: str, version: int, weights_sha256: str) -> str:
    """The served name of an adapter version (vLLM's LoRARequest name, the transformers backend's peft adapter
    name): its id, version and the weights' hash, so new weights are never served under an old name. The one
    place the name is built (AdapterManifest.name; serving's vLLM request from the files' manifest)."""
    return f"{adapter_id}@v{version}-{weights_sha256[:16]}"


@dataclass(frozen=True)
class AdapterManifest:
    user_id: str
    version: int  # 1, 2, ... per user; a version is never rewritten
    base_fingerprint: str  # digest of the base model's Fingerprint
    facts: tuple[FactRef, ...]
    seed: int
    sha256: str  # of the weights file (adapter_model.safetensors)
    config_sha256: str  # of adapter_config.json
    created_at: str  # ISO 8601 UTC
    passed: bool  # the gates admitted it; only passed versions can be activated
    reason: str = ""  # why the gates refused it ("" when passed)
    gates: dict[str, float] = field(default_factory=dict)  # gate figures (recalls, KL, agreement, ...)
    train: dict[str, Any] = field(default_factory=dict)  # training figures (steps, loss, seconds, ...)
    # the facts it is served for: those whose every gate question it answered (the others stay in KV/text);
    # None: all of its facts
    served_ids: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.served_ids is not None and not set(self.served_ids) <= set(self.memory_ids):
            raise AdapterCorrupt(f"adapter v{self.version} serves memories it was not trained on")

    @property
    def adapter_id(self) -> str:
        """What a plan carries: the version's directory relative to DATA_DIR/adapters."""
        return f"{user_key(self.user_id)}/v{self.version:04d}"

    @property
    def name(self) -> str:
        """The served name (vLLM's LoRARequest name, the transformers backend's peft adapter name): carries
        the version and the weights' hash, so new weights are never served under an old name."""
        return adapter_name(self.adapter_id, self.version, self.sha256)

    @property
    def memory_ids(self) -> tuple[str, ...]:
        """Every memory trained into its weights (what the delete cascade looks for)."""
        return tuple(f.memory_id for f in self.facts)

    @property
    def served_memory_ids(self) -> tuple[str, ...]:
        """The memories it is served for: left out of the prompt while it is active."""
        return self.memory_ids if self.served_ids is None else self.served_ids

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["facts"] = [asdict(f) for f in self.facts]
        data["served_ids"] = None if self.served_ids is None else list(self.served_ids)
        data["format"] = FORMAT_VERSION
        data["adapter_id"] = self.adapter_id
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AdapterManifest:
        """Raises AdapterCorrupt naming what is wrong with a manifest that is not ours."""
        try:
            if data.get("format") != FORMAT_VERSION:
                raise ValueError(f"format {data.get('format')!r}, expected {FORMAT_VERSION}")
            facts = tuple(
                FactRef(str(f["memory_id"]), int(f["version"]), str(f["text_sha"])) for f in data["facts"]
            )
            return cls(
                user_id=str(data["user_id"]),
                version=int(data["version"]),
                base_fingerprint=str(data["base_fingerprint"]),
                facts=facts,
                seed=int(data["seed"]),
                sha256=str(data["sha256"]),
                config_sha256=str(data["config_sha256"]),
                created_at=str(data["created_at"]),
                passed=bool(data["passed"]),
                reason=str(data.get("reason", "")),
                gates={str(k): float(v) for k, v in dict(data.get("gates", {})).items()},
                train=dict(data.get("train", {})),
                served_ids=None
                if data.get("served_ids") is None
                else tuple(str(i) for i in data["served_ids"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise AdapterCorrupt(f"bad adapter manifest: {exc}") from exc

"""What one request carries into vLLM and what its result says about the KV block.

Owns the cache salt (isolation), the LoRA name of a plan's adapter, the vLLM sampling parameters of a request
and the KV fallback kind once vLLM says how many prompt tokens it reused. Pure functions: no engine, no store;
vLLM is imported only where its objects are built.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvmem.adapters.manifest import CONFIG_FILE, MANIFEST_FILE, WEIGHTS_FILE, adapter_name
from kvmem.checksum import file_sha256
from serving.backends.base import GenerationRequest, InvalidResponseFormat, ResponseFormat

if TYPE_CHECKING:
    from kvmem.kv.item import KVItem

log = logging.getLogger(__name__)


def cache_salt(user_id: str, block_item_id: str | None) -> str:
    """vLLM's cache salt for a request: from the user the server serves and the plan's block item, never from
    client input alone. Requests share cached blocks only when both match; a new item id starts cold."""
    key = f"kvmem-salt-v1\x00{user_id}\x00{block_item_id or ''}"
    return hashlib.sha256(key.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class AdapterRef:
    """A LoRA adapter as vLLM is given it: the name carries the version and the files' hash, so a new version
    is a new adapter to vLLM (and to its per-adapter prefix cache)."""

    name: str
    int_id: int
    path: str


# beside the peft files; the parametric tier's registry writes them (kvmem.adapters.manifest's names)
ADAPTER_MANIFEST, ADAPTER_WEIGHTS, ADAPTER_CONFIG = MANIFEST_FILE, WEIGHTS_FILE, CONFIG_FILE


# Bounds of the two per-process maps below (issue 27 item 6): adapter names whose vLLM id is remembered and
# adapter files whose hash is remembered, least recently used dropped first. Each entry is ~200 bytes; 4,096
# covers the adapters a server serves at once many times over (vLLM itself keeps max_loras of them loaded).
MAX_LORA_NAMES = 4096
MAX_HASHED_FILES = 4096


class LoraIds:
    """vLLM's `lora_int_id` per adapter name: vLLM keeps loaded adapters by this id, so two names must never
    share one (a hash of the name could collide); ids are handed out in order, one per name, and never reused
    while this process (and so its engine) lives. At most `max_names` names are remembered (LRU): a name
    forgotten and asked for again gets a new id, which vLLM loads as a new adapter (its own LRU drops the old
    one), so forgetting costs a reload, never a shared id. Thread-safe."""

    def __init__(self, max_names: int = MAX_LORA_NAMES) -> None:
        if max_names < 1:
            raise ValueError(f"LoraIds.max_names must be >= 1, got {max_names!r}")
        self.max_names = max_names
        self._ids: OrderedDict[str, int] = OrderedDict()
        self._next_id = 1
        self._lock = threading.Lock()

    def of(self, name: str) -> int:
        with self._lock:
            found = self._ids.get(name)
            if found is not None:
                self._ids.move_to_end(name)
                return found
            found, self._next_id = self._next_id, self._next_id + 1
            self._ids[name] = found
            while len(self._ids) > self.max_names:
                self._ids.popitem(last=False)
            return found

    def __len__(self) -> int:
        return len(self._ids)


class FileHashes:
    """Adapter files' sha256 (kvmem.checksum.file_sha256), hashed again only when a file's inode, size or mtime changed (a request names
    its adapter each time; its weights are not read each time). At most `max_files` paths are remembered
    (LRU): a forgotten one is hashed again when asked for. Thread-safe."""

    def __init__(self, max_files: int = MAX_HASHED_FILES) -> None:
        if max_files < 1:
            raise ValueError(f"FileHashes.max_files must be >= 1, got {max_files!r}")
        self.max_files = max_files
        self._hashes: OrderedDict[str, tuple[tuple[int, int, int], str]] = OrderedDict()
        self._lock = threading.Lock()

    def sha256(self, path: Path) -> str:
        """The file's sha256 hex. Raises OSError."""
        st = path.stat()
        key = (st.st_ino, st.st_size, st.st_mtime_ns)
        with self._lock:
            known = self._hashes.get(str(path))
            if known is not None and known[0] == key:
                self._hashes.move_to_end(str(path))
                return known[1]
        digest = file_sha256(path)
        with self._lock:
            self._hashes[str(path)] = (key, digest)
            self._hashes.move_to_end(str(path))
            while len(self._hashes) > self.max_files:
                self._hashes.popitem(last=False)
        return digest

    def __len__(self) -> int:
        return len(self._hashes)


LORA_IDS = LoraIds()
FILE_HASHES = FileHashes()


def adapter_ref(
    adapters_dir: Path, adapter_id: str, ids: LoraIds = LORA_IDS, hashes: FileHashes = FILE_HASHES
) -> AdapterRef | None:
    """The adapter `adapter_id` under DATA_DIR/adapters, or None (logged) when it is not there or its files
    are not the ones its manifest names.

    Expects `<adapters_dir>/<adapter_id>/kvmem_adapter.json` with `{"version": int, "sha256": str}` (the
    weights file's sha256; `config_sha256` too when given) beside the peft files. The hashes are checked
    against the files, so a name (`<adapter_id>@v<version>-<sha256[:16]>`, as the registry names a version)
    is never served with weights other than the ones it was made for."""
    directory = adapters_dir / adapter_id
    try:
        manifest = json.loads((directory / ADAPTER_MANIFEST).read_text())
        version, sha = int(manifest["version"]), str(manifest["sha256"])
        config_sha = manifest.get("config_sha256")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    try:
        found = hashes.sha256(directory / ADAPTER_WEIGHTS)
        found_config = None if config_sha is None else hashes.sha256(directory / ADAPTER_CONFIG)
    except OSError as exc:
        log.warning("adapter %s: unreadable files (%s)", adapter_id, exc)
        return None
    if found != sha or found_config != config_sha:
        log.warning(
            "adapter %s: its files do not match its manifest (version %d); not served", adapter_id, version
        )
        return None
    name = adapter_name(adapter_id, version, sha)
    return AdapterRef(name=name, int_id=ids.of(name), path=str(directory))


def lora_request_for(adapters_dir: Path, adapter_id: str | None, enabled: bool) -> Any:
    """vLLM's LoRARequest for a plan's adapter, or None (no adapter, LoRA off, or no files: logged)."""
    if adapter_id is None:
        return None
    ref = adapter_ref(adapters_dir, adapter_id)
    if ref is None or not enabled:
        log.warning(
            "adapter %s not served (%s)", adapter_id, "no adapter files" if ref is None else "LoRA off"
        )
        return None
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=ref.name, lora_int_id=ref.int_id, lora_path=ref.path)


def sampling_params(req: GenerationRequest, max_context_tokens: int, eos_token_ids: Iterable[int]) -> Any:
    """vLLM's SamplingParams: token deltas as they come, EOS as the transformers backend knows it, at most the
    room the context leaves. Stop strings are not given to vLLM: the backend matches them (StopMatcher)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    sp = req.sampling
    room = max_context_tokens - len(req.prompt.ids)
    return SamplingParams(
        max_tokens=max(1, min(sp.max_new_tokens, room)),
        temperature=sp.temperature,
        top_p=sp.top_p,
        seed=sp.seed,
        presence_penalty=sp.presence_penalty,
        frequency_penalty=sp.frequency_penalty,
        logit_bias=dict(sp.logit_bias) or None,
        stop_token_ids=sorted(eos_token_ids),
        skip_special_tokens=True,
        output_kind=RequestOutputKind.DELTA,
        structured_outputs=structured_outputs(sp.response_format),
    )


def structured_outputs(fmt: ResponseFormat | None) -> Any:
    """vLLM's own guided decoding for a response format (its StructuredOutputsParams), compact JSON as the
    transformers backend's engine writes it; None for text."""
    if fmt is None:
        return None
    from vllm.sampling_params import StructuredOutputsParams

    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True, disable_any_whitespace=True)
    return StructuredOutputsParams(json=fmt.schema, disable_any_whitespace=True)


def check_structured_outputs(fmt: ResponseFormat) -> None:
    """Raises InvalidResponseFormat when vLLM's xgrammar backend (its default's first choice) refuses `fmt`."""
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.structured_output.backend_xgrammar import validate_xgrammar_grammar

    try:
        validate_xgrammar_grammar(SamplingParams(max_tokens=1, structured_outputs=structured_outputs(fmt)))
    except (VLLMValidationError, ValueError) as exc:
        raise InvalidResponseFormat(" ".join(str(exc).split())) from None


def fallback_after(
    req: GenerationRequest, item: KVItem | None, fallback: str | None, cached: int
) -> str | None:
    """The request's KV fallback kind, knowing how many prompt tokens vLLM reused. A block vLLM held in its
    prefix cache under this user's salt was served from activation memory even when its item was unusable;
    a lent item that vLLM did not take in full (the connector could not load it) is a fallback."""
    if fallback is not None:
        return None if cached >= req.prompt.block_len else fallback
    if item is not None and cached < min(item.num_tokens, len(req.prompt.ids) - 1):
        log.warning(
            "KV item %s was not loaded in full for request %s (%d tokens reused)",
            item.item_id,
            req.request_id,
            cached,
        )
        return "other"
    return None

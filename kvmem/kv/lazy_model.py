"""A model handle that loads the weights only when a block must be prefilled.

`kvmem build` resuming over a data dir where everything is built needs the tokenizer (block ids) and the
model's fingerprint (item ids), not the weights. The fingerprint hashes the weights, so it is cached per
model in DATA_DIR/build/fingerprints.json, keyed by the model's resolved path, dtype, device and layout
version, and valid while the model's files keep their names, sizes and modification times. A model named by
a hub id (no local files) is always loaded. When the weights are loaded, their fingerprint must equal the
cached one (else the files changed under the cache: ModelLoadError, re-run).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from kvmem.errors import ModelLoadError
from kvmem.kv.fingerprint import Fingerprint


def _signature(path: Path) -> list[list] | None:
    """(name, size, mtime_ns) of the model's files; None when there are no local files to sign."""
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file())
    else:
        return None
    return [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]


class LazyHandle:
    """Quacks like kvmem.models.ModelHandle; `.model`, `.device` and `.dtype` load the weights."""

    def __init__(
        self,
        model: str | None,
        *,
        device: str = "cpu",
        dtype: str | None = None,
        cache_file: Path,
        layout_version: str | None = None,
    ):
        from transformers import AutoConfig, AutoTokenizer

        from kvmem.kv.layout import LAYOUT_VERSION
        from kvmem.models import DEFAULT_MODEL_NAME, parse_dtype, resolve_model_path

        layout_version = LAYOUT_VERSION if layout_version is None else layout_version
        self._spec, self._device, self._dtype_name = model, device, dtype
        self._layout_version, self._cache_file = layout_version, cache_file
        self.model_id = model or DEFAULT_MODEL_NAME
        path = resolve_model_path(model)
        if (path.startswith((".", "/", "~")) or path.endswith(".gguf")) and not Path(path).exists():
            raise ModelLoadError(f"model path {path!r} does not exist")
        src, kwargs = path, {}
        if path.endswith(".gguf"):
            src, kwargs = str(Path(path).parent), {"gguf_file": Path(path).name}
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(src, **kwargs)
            config = AutoConfig.from_pretrained(src, **kwargs)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"could not load model {path!r}: {str(exc).splitlines()[0]}") from exc
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.max_context_tokens = int(getattr(text, "max_position_embeddings", 2048))
        signature = _signature(Path(path))
        self._key = json.dumps(
            [str(Path(path).resolve()), str(parse_dtype(dtype, device)), str(device), str(layout_version)]
        )
        self._signature = signature
        self._handle: Any = None
        cached = self._read_cache().get(self._key) if signature is not None else None
        if cached is not None and cached.get("signature") == signature:
            self.fingerprint = Fingerprint.from_dict(cached["fingerprint"])
        else:
            self._load()  # no valid cache entry: the fingerprint needs the weights
            self.fingerprint = self._handle.fingerprint

    @property
    def loaded(self) -> bool:
        return self._handle is not None

    def _read_cache(self) -> dict:
        try:
            data = json.loads(self._cache_file.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def _load(self) -> Any:
        if self._handle is None:
            from kvmem.models import load_model

            handle = load_model(
                self._spec, device=self._device, dtype=self._dtype_name, layout_version=self._layout_version
            )
            cached = getattr(self, "fingerprint", None)
            if cached is not None and cached != handle.fingerprint:
                raise ModelLoadError(
                    "the model's files changed since their fingerprint was cached "
                    f"({self._cache_file}); run the build again"
                )
            self._handle = handle
            if self._signature is not None:
                self._write_cache(handle.fingerprint)
        return self._handle

    def _write_cache(self, fingerprint: Fingerprint) -> None:
        data = self._read_cache()
        data[self._key] = {"signature": self._signature, "fingerprint": fingerprint.to_dict()}
        self._cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self._cache_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, self._cache_file)

    @property
    def model(self) -> Any:
        return self._load().model

    @property
    def device(self) -> Any:
        return self._load().device

    @property
    def dtype(self) -> Any:
        return self._load().dtype

    @property
    def kv_bytes_per_token(self) -> int:
        return self._load().kv_bytes_per_token

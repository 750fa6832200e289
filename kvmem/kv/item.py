"""A KV item: the precomputed keys/values of a token sequence, its manifest and its content address.

Owns the in-memory shape of an item and how one is made from K/V a forward computed (`item_from_kv`); the
prefill that computes them is prefill.py's. Does not know tiers, files, models or users' memories beyond the
ids it is told it covers. An item is immutable: nothing in kvmem writes into `kv` after build.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field

import torch

from kvmem.kv.fingerprint import Fingerprint


def tokens_sha(token_ids: tuple[int, ...] | list[int]) -> str:
    return hashlib.sha256(",".join(map(str, token_ids)).encode()).hexdigest()


def item_id_for(
    user_id: str, fingerprint: Fingerprint, token_ids: tuple[int, ...], memory_ids: tuple[str, ...] = ()
) -> str:
    """Content address: the same user, model, tokens and memory ids always give the same id (resumable builds).

    Memory ids are part of the address so the delete cascade can always find every item built from a memory.
    """
    key = f"{user_id}\x00{fingerprint.digest}\x00{tokens_sha(token_ids)}\x00{','.join(memory_ids)}"
    return hashlib.sha256(key.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class KVItemMeta:
    """Everything about an item except its tensors; serialized as the JSON manifest."""

    item_id: str
    user_id: str
    num_tokens: int
    num_bytes: int
    memory_ids: tuple[str, ...]
    fingerprint: Fingerprint
    tokens_sha: str
    created_at: float
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    # A child of a shared parent item (the deployment's knowledge, kvmem.kv.knowledge): its first
    # `parent_tokens` tokens are the parent's, whose K/V are stored once, in the parent only.
    parent_id: str | None = None
    parent_tokens: int = 0

    @property
    def stored_bytes(self) -> int:
        """Bytes of the tokens this item stores itself (`num_bytes` less a parent's part): what it costs in
        every tier and on disk; the parent's part is counted once, in the parent."""
        if not self.parent_tokens or not self.num_tokens:
            return self.num_bytes
        return self.num_bytes // self.num_tokens * (self.num_tokens - self.parent_tokens)

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["memory_ids"] = list(self.memory_ids)
        d["fingerprint"] = self.fingerprint.to_dict()
        if self.parent_id is None:  # manifests of items without a parent stay as they were
            del d["parent_id"], d["parent_tokens"]
        return d

    @classmethod
    def from_dict(cls, data: dict) -> KVItemMeta:
        return cls(
            item_id=str(data["item_id"]),
            user_id=str(data["user_id"]),
            num_tokens=int(data["num_tokens"]),
            num_bytes=int(data["num_bytes"]),
            memory_ids=tuple(str(m) for m in data["memory_ids"]),
            fingerprint=Fingerprint.from_dict(data["fingerprint"]),
            tokens_sha=str(data["tokens_sha"]),
            created_at=float(data["created_at"]),
            num_layers=int(data["num_layers"]),
            num_kv_heads=int(data["num_kv_heads"]),
            head_dim=int(data["head_dim"]),
            dtype=str(data["dtype"]),
            parent_id=None if data.get("parent_id") is None else str(data["parent_id"]),
            parent_tokens=int(data.get("parent_tokens", 0)),
        )


@dataclass(frozen=True, eq=False)
class KVItem:
    """Token ids + stacked K/V. `kv` is shared read-only by every request that injects this item.

    `kv` holds the K/V of the last `kv.shape[3]` tokens: all of them, or for a child of a shared parent
    (`meta.parent_id`) its own tokens only, the first `own_start` tokens' K/V being the `parent` item's
    (views, not copies: the parent is resident once, whatever number of children use it). A child the
    store holds in a tier has no `parent` attached (`complete` is False); `TieredKVStore.get` attaches it.
    """

    meta: KVItemMeta
    token_ids: tuple[int, ...]
    kv: torch.Tensor = field(repr=False)  # [layers, 2, kv_heads, tokens, head_dim]
    parent: KVItem | None = field(default=None, repr=False)

    @property
    def item_id(self) -> str:
        return self.meta.item_id

    @property
    def num_tokens(self) -> int:
        return self.meta.num_tokens

    @property
    def own_start(self) -> int:
        """The first token whose K/V `kv` holds (0: all of them)."""
        return self.meta.num_tokens - self.kv.shape[3]

    @property
    def complete(self) -> bool:
        """Every token's K/V is reachable: in `kv`, or the head in the attached parent."""
        return self.own_start == 0 or (self.parent is not None and self.parent.num_tokens >= self.own_start)

    @property
    def resident_bytes(self) -> int:
        """Bytes this item's own tensor holds (a parent's are the parent's)."""
        return self.kv.numel() * self.kv.element_size()

    def bare(self) -> KVItem:
        """The item without its parent attached: what a store tier holds."""
        return self if self.parent is None else KVItem(self.meta, self.token_ids, self.kv)

    def kv_range(self, start: int, end: int, *, layer: int | None = None) -> torch.Tensor:
        """K/V of tokens [start, end) ([layers, 2, kv_heads, end-start, head_dim], or one layer's
        [2, kv_heads, ...]): a view when they lie in one tensor, else one new tensor joining the parent's
        part and this item's own (the only copy; the caller owns it)."""
        own = self.own_start
        kv = self.kv if layer is None else self.kv[layer]
        if start >= own:
            return kv[..., start - own : end - own, :]
        if self.parent is None or self.parent.num_tokens < own:
            raise ValueError(f"KV item {self.item_id}: tokens before {own} are its parent's, not attached")
        head = self.parent.kv_range(start, min(end, own), layer=layer)
        if end <= own:
            return head
        return torch.cat([head, kv[..., : end - own, :]], dim=-2)

    def to(self, device: torch.device | str) -> KVItem:
        """A copy on another device (tier moves); the same item when already there."""
        parent = None if self.parent is None else self.parent.to(device)
        if self.kv.device == torch.device(device) and parent is self.parent:
            return self
        return KVItem(self.meta, self.token_ids, self.kv.to(device, non_blocking=False), parent)


def item_from_kv(
    ids: tuple[int, ...],
    kv: torch.Tensor,
    *,
    user_id: str,
    memory_ids: tuple[str, ...] | list[str],
    fingerprint: Fingerprint,
    own_start: int = 0,
) -> KVItem:
    """The item of `ids` whose K/V a forward computed: kv [layers, 2, kv_heads, tokens, head_dim], the K/V
    of `ids[own_start:]` (a child's own tokens: the caller sets its parent; `num_bytes` counts every token,
    as for a kv of all of them)."""
    ids = tuple(ids)
    num_layers, _, num_heads, own_tokens, head_dim = kv.shape
    assert own_start + own_tokens == len(ids) and own_tokens > 0, (own_start, own_tokens, len(ids))
    meta = KVItemMeta(
        item_id=item_id_for(user_id, fingerprint, ids, tuple(memory_ids)),
        user_id=user_id,
        num_tokens=len(ids),
        num_bytes=kv.numel() * kv.element_size() // own_tokens * len(ids),
        memory_ids=tuple(memory_ids),
        fingerprint=fingerprint,
        tokens_sha=tokens_sha(ids),
        created_at=time.time(),
        num_layers=num_layers,
        num_kv_heads=num_heads,
        head_dim=head_dim,
        dtype=str(kv.dtype).removeprefix("torch."),
    )
    return KVItem(meta=meta, token_ids=ids, kv=kv)

"""Injection: turn a stored KV item into the starting cache of one request, without copying it (a child of
the shared knowledge item: one request-owned copy joining the two, see `inject`).

Each cache layer starts as a *view* of the item's tensors; the first `update` of a forward pass
concatenates the request's own tokens into a new, request-owned tensor (exactly what DynamicCache does
for a cache already in place), so the stored tensors are never written. Knows nothing of tiers or HTTP.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

from kvmem.kv.item import KVItem


class SharedPrefixCache(DynamicCache):
    """A DynamicCache whose layers start as views of a stored item (see the module docstring)."""

    def __init__(self, layers: list[DynamicLayer]):
        Cache.__init__(self, layers=layers)


@dataclass(frozen=True)
class Injection:
    """The cache to pass as `past_key_values`, and how many prompt tokens it already covers."""

    cache: DynamicCache
    reused_tokens: int


def common_prefix_tokens(a: tuple[int, ...] | list[int], b: tuple[int, ...] | list[int]) -> int:
    n = min(len(a), len(b))
    if tuple(a[:n]) == tuple(b[:n]):
        return n
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def usable_prefix_tokens(item: KVItem, prompt_ids: tuple[int, ...] | list[int]) -> int:
    """Tokens of the item a prompt can reuse: the common prefix, leaving at least one token to prefill."""
    return min(common_prefix_tokens(item.token_ids, prompt_ids), len(prompt_ids) - 1)


def _shared_layer(keys: torch.Tensor, values: torch.Tensor) -> DynamicLayer:
    layer = DynamicLayer()
    layer.dtype, layer.device = keys.dtype, keys.device
    layer.keys, layer.values = (
        keys,
        values,
    )  # views of the stored item; DynamicLayer.update never writes into them
    layer.is_initialized = True
    return layer


def inject(item: KVItem, prompt_ids: tuple[int, ...] | list[int]) -> Injection:
    """A fresh cache whose first `reused_tokens` positions are the item's K/V for the prompt's prefix."""
    n = usable_prefix_tokens(item, prompt_ids)
    if n <= 0:
        return Injection(cache=DynamicCache(), reused_tokens=0)
    # [layers, 2, kv_heads, n, head_dim]: a view of the item; for a child of a shared parent (the knowledge)
    # reaching past the parent's tokens, one request-owned tensor joining the parent's K/V and the child's own
    # (the stored items are never joined: the parent stays resident once). The first forward's update then
    # concatenates the request's tokens onto it, as DynamicCache does for every cache.
    return Injection(cache=cache_of(item.kv_range(0, n)), reused_tokens=n)


def cache_of(kv: torch.Tensor) -> SharedPrefixCache:
    """A cache whose layers are views of kv ([layers, 2, kv_heads, n, head_dim]); never written."""
    return SharedPrefixCache(
        [_shared_layer(kv[i, 0].unsqueeze(0), kv[i, 1].unsqueeze(0)) for i in range(kv.shape[0])]
    )

"""Appending a decode step's K/V to a cache layer without copying the whole layer each time.

`DynamicLayer.update` concatenates: every token copies the layer's whole K and V into new tensors, so a
sequence of n tokens copies O(n^2) bytes over its life (with 8 sequences decoding, 30 layers, 2 tensors:
480 full copies per step). `append` keeps, beside a layer, a buffer with room to spare (its capacity grows
by half each time it is full) and writes the new positions into it; the layer's `keys` / `values` become
views of the buffer's first positions. The values a forward reads are exactly the same numbers, so outputs
do not change.

Ownership rule, which keeps stored tensors immutable: `append` writes only into a buffer it allocated for
this layer, and only past the end of the layer's current view of it. A layer whose keys are views of
something else (an injected KV item, a session entry, a prefix view) gets a new buffer on its first append:
one copy, as the concatenation would have made. Anyone holding an earlier view of the buffer (a session
entry cut to n positions, the state saved before a batched step) sees the same numbers forever: positions
before the view's end are never written again. The layer stays a plain `DynamicLayer`: a later
`update` by transformers concatenates as usual (and the buffer is then simply dropped at the next append).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

_BUF = (
    "_kvmem_buffer"  # attribute of a DynamicLayer: (keys buffer, values buffer) [batch, heads, capacity, dim]
)
MIN_SPARE = 64  # positions of room a new buffer has at least beyond what it holds


def _owned_length(layer: DynamicLayer) -> int | None:
    """How many positions of the layer's own buffer its current view covers; None if the view is not of it."""
    buf = getattr(layer, _BUF, None)
    if buf is None:
        return None
    kbuf, vbuf = buf
    keys, values = layer.keys, layer.values
    n = keys.shape[-2]
    if (
        keys.data_ptr() != kbuf.data_ptr()
        or values.data_ptr() != vbuf.data_ptr()
        or keys.stride() != kbuf.stride()
        or values.stride() != vbuf.stride()
        or keys.shape[:-2] != kbuf.shape[:-2]
        or keys.shape[-1] != kbuf.shape[-1]
        or values.shape[:-2] != vbuf.shape[:-2]
        or values.shape[-1] != vbuf.shape[-1]
        or values.shape[-2] != n
    ):
        return None
    return n


def append(layer: DynamicLayer, key_states: torch.Tensor, value_states: torch.Tensor):
    """`layer.update(key_states, value_states)` with the same result: (keys, values) of every position so far,
    the new ones last; the layer's own buffer takes the new positions when it has room."""
    if not getattr(layer, "is_initialized", False) or layer.keys is None or layer.keys.numel() == 0:
        return layer.update(key_states, value_states)  # nothing to append to: the plain path
    n, k = layer.keys.shape[-2], key_states.shape[-2]
    owned = _owned_length(layer)
    if owned is None or n + k > getattr(layer, _BUF)[0].shape[-2]:
        need = n + k
        capacity = need + max(MIN_SPARE, need // 2)
        kbuf = layer.keys.new_empty((*layer.keys.shape[:-2], capacity, layer.keys.shape[-1]))
        vbuf = layer.values.new_empty((*layer.values.shape[:-2], capacity, layer.values.shape[-1]))
        kbuf[..., :n, :] = layer.keys
        vbuf[..., :n, :] = layer.values
        setattr(layer, _BUF, (kbuf, vbuf))
    kbuf, vbuf = getattr(layer, _BUF)
    kbuf[..., n : n + k, :] = key_states
    vbuf[..., n : n + k, :] = value_states
    layer.keys, layer.values = kbuf[..., : n + k, :], vbuf[..., : n + k, :]
    return layer.keys, layer.values

"""Building a KV item by prefill: the block's tokens run through the model once and their K/V are kept.

Owns the build step's checks (an empty or over-long block, token ids outside the vocabulary) and the prefill
over a prefix item's injected K/V. Knows nothing of tiers, files or which memories a block holds beyond the
ids it is told; the item's shape and manifest are item.py's, the injection inject.py's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache

from kvmem.errors import InvalidBlock
from kvmem.kv.fingerprint import Fingerprint
from kvmem.kv.inject import inject
from kvmem.kv.item import KVItem, item_from_kv

if TYPE_CHECKING:
    from kvmem.models import ModelHandle


def build_item(
    handle: ModelHandle,
    token_ids: list[int] | tuple[int, ...],
    *,
    user_id: str,
    memory_ids: tuple[str, ...] | list[str] = (),
    prefix: KVItem | None = None,
    fingerprint: Fingerprint | None = None,
) -> KVItem:
    """Prefill `token_ids` once and keep the K/V. Raises InvalidBlock for an empty or over-long block.

    With `prefix` (an item whose tokens start `token_ids`, e.g. the block before memories were appended), only
    the new tokens are prefilled, over the prefix's K/V, exactly as a request would; the prefix is not modified.
    `fingerprint` (default: the model's) is what the caller runs the model as: `handle.fingerprint.under(name)`
    while it has the LoRA adapter `name` switched on for this call.
    """
    ids = tuple(int(t) for t in token_ids)
    if not ids:
        raise InvalidBlock("cannot build a KV item from an empty block (0 tokens)")
    limit = handle.max_context_tokens - 1  # at least one prompt token must follow the block
    if len(ids) > limit:
        raise InvalidBlock(
            f"block of {len(ids)} tokens exceeds the model context ({handle.max_context_tokens} "
            f"tokens, of which at most {limit} can be a block)"
        )
    vocab = handle.model.config.get_text_config().vocab_size
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise InvalidBlock(f"block has token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
    model = handle.model
    fingerprint = fingerprint or handle.fingerprint
    # every position's K/V, for sliding-window layers too: the model's own mask keeps each layer's window, and
    # a sliding cache layer (DynamicCache(config=...)) would drop the positions an item must keep
    cache, start = DynamicCache(), 0
    if prefix is not None and prefix.meta.fingerprint == fingerprint:
        injection = inject(prefix, ids)
        cache, start = injection.cache, injection.reused_tokens
    input_ids = torch.tensor([ids[start:]], dtype=torch.long, device=handle.device)
    with torch.inference_mode():
        model(
            input_ids=input_ids,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
            cache_position=torch.arange(start, len(ids), device=handle.device),
        )
        kv = torch.stack([torch.stack([layer.keys[0], layer.values[0]]) for layer in cache.layers])
    del cache
    return item_from_kv(ids, kv, user_id=user_id, memory_ids=memory_ids, fingerprint=fingerprint)

"""Activation memory: KV items built by prefill, bound by fingerprint, stored in tiers, injected zero-copy.

Knows nothing of HTTP, scheduling policy or how memories are chosen.
"""

from kvmem.kv.decode import GenerationStats, Sampling, eos_token_ids, generate
from kvmem.kv.fingerprint import Fingerprint, fingerprint_model
from kvmem.kv.inject import Injection, inject, usable_prefix_tokens
from kvmem.kv.item import KVItem, KVItemMeta, item_id_for
from kvmem.kv.layout import LAYOUT_VERSION, LaidOutPrompt, LayoutError, PromptLayout
from kvmem.kv.prefill import build_item
from kvmem.kv.store import KVStoreConfig, SizeInfo, TieredKVStore, TierSize

__all__ = [
    "Fingerprint",
    "GenerationStats",
    "Injection",
    "KVItem",
    "KVItemMeta",
    "KVStoreConfig",
    "LAYOUT_VERSION",
    "LaidOutPrompt",
    "LayoutError",
    "PromptLayout",
    "Sampling",
    "SizeInfo",
    "TierSize",
    "TieredKVStore",
    "build_item",
    "eos_token_ids",
    "fingerprint_model",
    "generate",
    "inject",
    "item_id_for",
    "usable_prefix_tokens",
]

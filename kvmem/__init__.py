"""kvmem: the memory tiers as data and storage (plaintext, activation KV, LoRA adapters).

Knows nothing of HTTP or scheduling policy.
"""

"""Parametric memory: a user's stable memories distilled into LoRA adapters (peft safetensors + JSON manifest),
versioned per user, one active version served. Training and gates live in scheduler/distill/."""

from kvmem.adapters.active import ActiveAdapters
from kvmem.adapters.manifest import (
    AdapterCorrupt,
    AdapterError,
    AdapterManifest,
    AdapterMismatch,
    AdapterNotFound,
    FactRef,
    text_sha,
    user_key,
)
from kvmem.adapters.registry import AdapterRegistry, LoadedAdapter

__all__ = [
    "ActiveAdapters",
    "AdapterCorrupt",
    "AdapterError",
    "AdapterManifest",
    "AdapterMismatch",
    "AdapterNotFound",
    "AdapterRegistry",
    "FactRef",
    "LoadedAdapter",
    "text_sha",
    "user_key",
]
